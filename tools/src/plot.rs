//! PNG charts for the benchmarks (plotters, bitmap backend).
//!
//! Text is drawn with a TrueType font loaded at run time from the system
//! (Debian's fonts-dejavu-core); a missing font makes the chart fail with a
//! clear error, which the benchmarks report as a warning: the table and the
//! CSV are the results, the PNG is a view of them.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Result};
use plotters::prelude::*;

const FONT_PATHS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

fn ensure_font() -> Result<()> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let bytes = FONT_PATHS.iter().find_map(|p| std::fs::read(p).ok()).ok_or_else(|| {
                format!("no DejaVuSans.ttf in {FONT_PATHS:?} (apt-get install fonts-dejavu-core)")
            })?;
            // plotters keeps fonts for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| "DejaVuSans.ttf is not a usable font".to_string())
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// A bar per label (log-scale y), e.g. p50 latency per verb.
pub fn bars(path: &Path, title: &str, y_label: &str, bars: &[(String, f64)]) -> Result<()> {
    ensure_font()?;
    let root = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let max = bars.iter().map(|b| b.1).fold(1.0, f64::max) * 2.0;
    let min = bars.iter().map(|b| b.1).filter(|v| *v > 0.0).fold(max, f64::min) / 2.0;
    let n = bars.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(160)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..n as f64, (min..max).log_scale())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            bars.get(i).filter(|_| (x - i as f64 - 0.5).abs() < 0.26).map(|b| b.0.clone()).unwrap_or_default()
        })
        .x_label_style(("sans-serif", 13).into_font().transform(FontTransform::Rotate90))
        .y_desc(y_label)
        .draw()?;
    chart.draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
        Rectangle::new([(i as f64 + 0.15, min), (i as f64 + 0.85, *v)], BLUE.mix(0.6).filled())
    }))?;
    root.present()?;
    Ok(())
}
