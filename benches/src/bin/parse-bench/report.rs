//! What a run writes besides its per-prompt results: the result record, the CPU time of a cluster, the tables and the plot.

use super::*;

/// The run as a result record: a cell per configuration with its speed, its work per token and, beside them, the
/// quality of its outputs against the first configuration's (the reference, `target` by default) on the same
/// prompts.
pub(super) fn result_record(
    args: &Args,
    quality_name: &str,
    budget: usize,
    prompts: usize,
    rows: &[Value],
) -> parse_record::Record {
    let where_ = match &args.router {
        Some(_) => format!("through the router, {} client(s)", args.clients),
        None => "in process, one request at a time".to_string(),
    };
    let mut record = parse_record::Record::new(
        "parse-bench",
        format!(
            "{}: {prompts} prompts, {where_}, {}",
            args.suite,
            if args.cuts_at_code_block() {
                "replies cut at the code block's close"
            } else {
                "whole replies"
            }
        ),
        json!({
            "suite": args.suite, "prompts": prompts, "skip": args.skip, "max_new_tokens": budget,
            "cut_at_code_block": args.cuts_at_code_block(),
            "router": args.router, "clients": args.clients, "repeat": args.repeat,
        }),
    );
    let reference = rows.first().and_then(|r| r["quality"].as_f64());
    for (i, r) in rows.iter().enumerate() {
        let figure = |k: &str| r[k].clone();
        let mut cell = parse_record::Cell::new(r["run"].as_str().unwrap_or_default())
            .figure("tokens_per_s", figure("tokens_per_s"))
            .figure("x_target", figure("speedup_vs_target"))
            .figure("target_passes_per_token", figure("target_passes_per_token"))
            .figure("draft_share", figure("draft_share"));
        if r["speedup_mean"].is_number() {
            cell = cell
                .figure("x_target_by_repetition", figure("speedup_by_repeat"))
                .figure("x_target_mean", figure("speedup_mean"))
                .figure("x_target_ci95", figure("speedup_ci95"));
        }
        if let Some(q) = r["quality"].as_f64() {
            cell = cell.quality(parse_record::Quality {
                metric: quality_name.to_string(),
                value: q,
                reference: if i == 0 { None } else { reference },
                n: prompts,
            });
        }
        if args.headline && i > 0 {
            cell = cell.headline();
        }
        record.push(cell);
    }
    record
}

/// The CPU seconds of the processes whose `/metrics` are at `addrs`, summed (`process_cpu_seconds_total`).
pub(super) fn cluster_cpu(addrs: &[String]) -> Result<f64> {
    let mut sum = 0.0;
    for addr in addrs {
        let text = parse_bench::scrape_metrics(addr)?;
        sum += parse_bench::metric_value(&text, "process_cpu_seconds_total")
            .with_context(|| format!("http://{addr}/metrics has no process_cpu_seconds_total"))?;
    }
    Ok(sum)
}

/// One cell through a router: its prompts' results, its wall seconds and, with --cpu-metrics, the cluster's CPU
/// seconds.
pub(super) type Cell = (Vec<Saved>, f64, Option<f64>);

/// The CPU table of a run with --cpu-metrics (`rows[0]` is `target`'s): each row's CPU milliseconds per output token,
/// `target`'s figure over it, and with more than one repetition each repetition's such ratio with their mean and its
/// 95% interval (also written into the rows).
pub(super) fn cpu_table(rows: &mut [Value], addrs: &[String]) -> String {
    let figures = |r: &Value| row_numbers(r, "cpu_ms_per_token_by_repeat");
    let base = rows[0]["cpu_ms_per_token"].as_f64().unwrap_or(f64::NAN);
    let base_by_repeat = figures(&rows[0]);
    let mut md = format!(
        "\nCPU time per output token: `process_cpu_seconds_total` of {} summed over each cell; x target is `target`'s CPU per token over the run's (above 1: it costs less CPU a token). By repetition: each against the same repetition's `target` cell, their mean and its 95% interval.\n\n| run | CPU ms/token | x target | x target by repetition | mean | 95% interval |\n|---|---:|---:|---|---:|---:|\n",
        addrs.join(", ")
    );
    for r in rows.iter_mut() {
        let c = r["cpu_ms_per_token"].as_f64().unwrap_or(f64::NAN);
        let ratios: Vec<f64> = base_by_repeat
            .iter()
            .zip(figures(r))
            .map(|(b, x)| b / x)
            .collect();
        let (mean, half) = mean_and_ci95(&ratios);
        // One repetition has no interval.
        let interval = if half.is_finite() {
            format!("{:.3} to {:.3}", mean - half, mean + half)
        } else {
            "-".into()
        };
        md.push_str(&format!(
            "| {} | {c:.2} | {:.3} | {} | {mean:.3} | {interval} |\n",
            r["run"].as_str().unwrap_or_default(),
            base / c,
            listed(&ratios, 3),
        ));
        r["cpu_x_target"] = json!(base / c);
        r["cpu_x_target_by_repeat"] = json!(ratios);
        r["cpu_x_target_ci95"] = json!([mean - half, mean + half]);
    }
    md
}

/// A row's tok/s of each repetition.
pub(super) fn tps_by_repeat(row: &Value) -> Vec<f64> {
    row_numbers(row, "tokens_per_s_by_repeat")
}

/// The numbers in a row's list `key` (none where it has no such list).
pub(super) fn row_numbers(row: &Value, key: &str) -> Vec<f64> {
    row[key]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

/// `xs` with `digits` decimals, separated by commas.
pub(super) fn listed(xs: &[f64], digits: usize) -> String {
    xs.iter()
        .map(|x| format!("{x:.digits$}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The mean of `xs` and the half-width of its 95% interval by Student's t (NaN with fewer than two values).
pub(super) fn mean_and_ci95(xs: &[f64]) -> (f64, f64) {
    let n = xs.len();
    let mean = xs.iter().sum::<f64>() / n.max(1) as f64;
    if n < 2 {
        return (mean, f64::NAN);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    // The 97.5% quantiles of t for 1..=30 degrees of freedom; past 30, the normal's with a small correction
    // (within 0.01 of t's).
    const T975: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    let df = n - 1;
    let t = T975.get(df - 1).copied().unwrap_or(1.96 + 2.4 / df as f64);
    (mean, t * (var / n as f64).sqrt())
}

/// Two plots, one line per (mode, verdict) over its tau values and single-setting modes as single points: quality
/// against the speed-up (`<suite>.svg`) and against the target's work, its forward passes per output token
/// (`<suite>-work.svg`; `target` mode is 1.0, the budget for `parse` 0.25), each with `target` mode as the
/// cross-hair.
pub(super) fn plot(
    path: &std::path::Path,
    suite: &str,
    quality: &str,
    rows: &[Value],
    base_q: f64,
) -> Result<()> {
    let series_of = |y_key: &str| {
        let mut series: Vec<Series> = Vec::new();
        for r in rows.iter().skip(1) {
            let mode = r["mode"].as_str().unwrap_or_default();
            let sweeps = mode.starts_with("parse");
            let name = if sweeps {
                format!("{mode} {}", r["verdict"].as_str().unwrap_or_default())
            } else {
                mode.to_string()
            };
            let label = if sweeps {
                format!("tau={}", r["tau"].as_f64().unwrap_or(f64::NAN) as f32)
            } else {
                String::new()
            };
            let point = (
                r["quality"].as_f64().unwrap_or(f64::NAN) * 100.0,
                r[y_key].as_f64().unwrap_or(f64::NAN),
                label,
            );
            match series.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push(point),
                None => series.push(Series {
                    name,
                    points: vec![point],
                }),
            }
        }
        series
    };
    scatter_svg(
        path,
        &format!("{suite}: speed-up vs {quality}"),
        &format!("{quality} (%)"),
        "x target tok/s",
        &series_of("speedup_vs_target"),
        (base_q * 100.0, 1.0),
    )?;
    let base_work = rows[0]["target_passes_per_token"]
        .as_f64()
        .unwrap_or(f64::NAN);
    scatter_svg(
        &path.with_file_name(format!("{suite}-work.svg")),
        &format!("{suite}: target passes per output token vs {quality}"),
        &format!("{quality} (%)"),
        "target passes / output token",
        &series_of("target_passes_per_token"),
        (base_q * 100.0, base_work),
    )
}
