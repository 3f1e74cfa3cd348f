//! A small scatter plot written as PNG: speed-up against quality over a tau sweep. Drawn here (8x8 bitmap font,
//! `png` encoder) so the harness needs no plotting stack, fonts or Python on the benchmark machine.

use std::path::Path;

use anyhow::Result;

const W: usize = 900;
const H: usize = 600;
const LEFT: usize = 90;
const RIGHT: usize = 30;
const TOP: usize = 50;
const BOTTOM: usize = 70;

type Rgb = [u8; 3];
const WHITE: Rgb = [255, 255, 255];
const BLACK: Rgb = [0, 0, 0];
const GREY: Rgb = [210, 210, 210];

/// Colours for series, cycled.
const PALETTE: [Rgb; 6] = [
    [31, 119, 180],
    [214, 39, 40],
    [44, 160, 44],
    [148, 103, 189],
    [255, 127, 14],
    [23, 190, 207],
];

/// One point: (x, y, label).
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64, String)>,
}

struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn new() -> Self {
        Canvas {
            px: [WHITE; W * H].concat(),
        }
    }

    fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x >= 0 && y >= 0 && (x as usize) < W && (y as usize) < H {
            let i = (y as usize * W + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: Rgb) {
        let n = (x1 - x0).abs().max((y1 - y0).abs()).max(1);
        for i in 0..=n {
            self.set(x0 + (x1 - x0) * i / n, y0 + (y1 - y0) * i / n, c);
        }
    }

    fn dot(&mut self, x: i64, y: i64, c: Rgb) {
        for dy in -4i64..=4 {
            for dx in -4i64..=4 {
                if dx * dx + dy * dy <= 16 {
                    self.set(x + dx, y + dy, c);
                }
            }
        }
    }

    /// Text at (x, y) top-left, 8x8 glyphs scaled by `s`.
    fn text(&mut self, x: i64, y: i64, s: i64, text: &str, c: Rgb) {
        for (k, ch) in text.chars().enumerate() {
            let code = if ch.is_ascii() {
                ch as usize
            } else {
                b'?' as usize
            };
            let glyph = font8x8::legacy::BASIC_LEGACY[code];
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8 {
                    if bits >> col & 1 == 1 {
                        for yy in 0..s {
                            for xx in 0..s {
                                self.set(
                                    x + (k as i64 * 8 + col) * s + xx,
                                    y + row as i64 * s + yy,
                                    c,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

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

/// Writes a scatter plot of every series (x in percent: at least 5 points of margin) (points joined in order) with a cross-hair at `reference`.
pub fn scatter_png(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    reference: (f64, f64),
) -> Result<()> {
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (x0, x1) = range(all().map(|p| p.0).chain([reference.0]), 5.0);
    let (y0, y1) = range(all().map(|p| p.1).chain([reference.1]), 0.05);
    let (pw, ph) = ((W - LEFT - RIGHT) as f64, (H - TOP - BOTTOM) as f64);
    let sx = |x: f64| (LEFT as f64 + (x - x0) / (x1 - x0) * pw) as i64;
    let sy = |y: f64| (TOP as f64 + (y1 - y) / (y1 - y0) * ph) as i64;
    let mut c = Canvas::new();
    // Grid and tick labels: five steps per axis.
    for i in 0..=5 {
        let fx = x0 + (x1 - x0) * i as f64 / 5.0;
        let fy = y0 + (y1 - y0) * i as f64 / 5.0;
        c.line((sx(fx), TOP as i64), (sx(fx), (H - BOTTOM) as i64), GREY);
        c.line((LEFT as i64, sy(fy)), ((W - RIGHT) as i64, sy(fy)), GREY);
        let xl = format!("{fx:.2}");
        c.text(
            sx(fx) - 4 * xl.len() as i64,
            (H - BOTTOM + 8) as i64,
            1,
            &xl,
            BLACK,
        );
        let yl = format!("{fy:.2}");
        c.text(
            LEFT as i64 - 8 - 8 * yl.len() as i64,
            sy(fy) - 4,
            1,
            &yl,
            BLACK,
        );
    }
    let (bl, br, bt, bb) = (
        LEFT as i64,
        (W - RIGHT) as i64,
        TOP as i64,
        (H - BOTTOM) as i64,
    );
    for (a, b) in [
        ((bl, bt), (br, bt)),
        ((bl, bb), (br, bb)),
        ((bl, bt), (bl, bb)),
        ((br, bt), (br, bb)),
    ] {
        c.line(a, b, BLACK);
    }
    // The reference (target mode) as a cross-hair.
    let (rx, ry) = (sx(reference.0), sy(reference.1));
    for d in (0..(br - bl)).step_by(6) {
        c.line((bl + d, ry), (bl + d + 3, ry), BLACK);
    }
    for d in (0..(bb - bt)).step_by(6) {
        c.line((rx, bt + d), (rx, bt + d + 3), BLACK);
    }
    c.text(rx + 6, ry - 12, 1, "target", BLACK);
    for (k, s) in series.iter().enumerate() {
        let col = PALETTE[k % PALETTE.len()];
        for w in s.points.windows(2) {
            c.line((sx(w[0].0), sy(w[0].1)), (sx(w[1].0), sy(w[1].1)), col);
        }
        for (x, y, label) in &s.points {
            c.dot(sx(*x), sy(*y), col);
            c.text(sx(*x) + 7, sy(*y) + 5, 1, label, col);
        }
        // Legend, top right.
        let ly = TOP as i64 + 10 + 14 * k as i64;
        c.dot(br - 200, ly + 4, col);
        c.text(br - 190, ly, 1, &s.name, col);
    }
    c.text(LEFT as i64, 15, 2, title, BLACK);
    c.text(
        (W / 2) as i64 - 4 * x_label.len() as i64,
        (H - 30) as i64,
        1,
        x_label,
        BLACK,
    );
    c.text(8, 30, 1, y_label, BLACK);
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut enc = png::Encoder::new(file, W as u32, H as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()?.write_image_data(&c.px)?;
    Ok(())
}
