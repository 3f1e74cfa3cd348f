//! Scatter plots of the benchmark harness (quality against speed-up or work over a tau sweep), drawn with
//! `plotters` as SVG: text stays text, so no font files or font libraries are needed on the benchmark machine.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

/// One series: points `(x, y, label)`, joined in order.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64, String)>,
}

/// `(min, max)` of the finite values, padded by a tenth of the span and at least `min_pad`.
fn range(vals: impl Iterator<Item = f64>, min_pad: f64) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in vals.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.1).max(min_pad);
    (lo - pad, hi + pad)
}

/// Writes an SVG scatter plot of every series (x in percent: at least 5 points of margin) with `reference` (the
/// target) as a dashed cross-hair.
pub fn scatter_svg(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    reference: (f64, f64),
) -> Result<()> {
    let fail = |e: &dyn std::fmt::Display| anyhow!("plotting {}: {e}", path.display());
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (x0, x1) = range(all().map(|p| p.0).chain([reference.0]), 5.0);
    let (y0, y1) = range(all().map(|p| p.1).chain([reference.1]), 0.05);
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| fail(&e))?;
    let (rx, ry) = reference;
    let dashed = BLACK.mix(0.6).stroke_width(1);
    chart
        .draw_series(DashedLineSeries::new([(x0, ry), (x1, ry)], 6, 4, dashed))
        .map_err(|e| fail(&e))?;
    chart
        .draw_series(DashedLineSeries::new([(rx, y0), (rx, y1)], 6, 4, dashed))
        .map_err(|e| fail(&e))?
        .label("target")
        .legend(|(x, y)| PathElement::new([(x - 8, y), (x + 8, y)], BLACK.mix(0.6)));
    for (k, s) in series.iter().enumerate() {
        let col = Palette99::pick(k).to_rgba();
        chart
            .draw_series(LineSeries::new(
                s.points.iter().map(|p| (p.0, p.1)),
                col.stroke_width(2),
            ))
            .map_err(|e| fail(&e))?
            .label(s.name.as_str())
            .legend(move |(x, y)| Circle::new((x, y), 4, col.filled()));
        chart
            .draw_series(s.points.iter().map(|(x, y, label)| {
                EmptyElement::at((*x, *y))
                    + Circle::new((0, 0), 4, col.filled())
                    + Text::new(
                        label.clone(),
                        (7, 3),
                        ("sans-serif", 12).into_font().color(&col),
                    )
            }))
            .map_err(|e| fail(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_plot_holds_its_series_points_and_labels() {
        let path = std::env::temp_dir().join(format!("parse-plot-{}.svg", std::process::id()));
        let series = [
            Series {
                name: "parse relative".into(),
                points: vec![(78.0, 1.2, "tau=0.9".into()), (74.0, 1.6, "tau=0.5".into())],
            },
            Series {
                name: "token-spec".into(),
                points: vec![(79.0, 1.1, String::new())],
            },
        ];
        scatter_svg(
            &path,
            "humaneval: speed-up",
            "pass@1 (%)",
            "x target",
            &series,
            (79.0, 1.0),
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        for text in [
            "humaneval: speed-up",
            "parse relative",
            "token-spec",
            "tau=0.9",
            "tau=0.5",
            "target",
        ] {
            assert!(svg.contains(text), "no `{text}` in the plot");
        }
        // Three points drawn as circles (legend markers add more).
        assert!(svg.matches("<circle").count() >= 3);
    }

    #[test]
    fn ranges_pad_and_survive_empty_input() {
        assert_eq!(range([].into_iter(), 5.0), (0.0, 1.0));
        assert_eq!(range([10.0, 20.0, f64::NAN].into_iter(), 0.5), (9.0, 21.0));
        assert_eq!(range([50.0].into_iter(), 5.0), (45.0, 55.0));
    }
}
