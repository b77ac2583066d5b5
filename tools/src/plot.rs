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
        // Ticks every half bar, so every bar centre (i + 0.5) gets one.
        .x_labels(2 * n + 1)
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

/// Distinct, readable line colours.
const LINE_COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(0, 0, 0),
];

/// One line per series over a shared x axis (linear axes from zero), e.g.
/// goodput against client count per lock algorithm.
pub fn lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    ensure_font()?;
    let root = BitMapBackend::new(path, (1000, 650)).into_drawing_area();
    root.fill(&WHITE)?;
    let points = || series.iter().flat_map(|s| s.1.iter());
    let x_max = points().map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let y_max = points().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(90)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = LINE_COLORS[i % LINE_COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
