//! The demo's picture: the ladder's wait-time ratios, and each loader's steps on one time axis
//! (waiting in red, computing in blue), so where the time goes is seen at a glance.
//!
//! Drawn with plotters into an RGB buffer and encoded as PNG with the `image` crate; the font
//! (DejaVu Sans, `data/fonts/`) is embedded, so nothing depends on the machine's fonts.

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use super::ladder::RungResult;

const FONT: &[u8] = include_bytes!("../../data/fonts/DejaVuSans.ttf");
const WAIT: RGBColor = RGBColor(214, 69, 65);
const COMPUTE: RGBColor = RGBColor(52, 101, 164);
const FEEDSTORE: RGBColor = RGBColor(46, 139, 87);

/// One cell of the scaling view: its setting and both loaders' wait-time ratios.
#[derive(Debug, Clone)]
pub struct ScalingCell {
    /// e.g. "4 ranks, batch 16, 30-80 ms".
    pub label: String,
    /// The prefetching loader's (copies) wait-time ratio.
    pub copies: f64,
    /// feedstore's.
    pub feedstore: f64,
}

/// Writes the picture of `rungs` (the ladder, then any other runs) and of the scaling view (if
/// any cells) to `path`.
pub fn write(
    path: &Path,
    title: &str,
    rungs: &[&RungResult],
    scaling: &[ScalingCell],
) -> anyhow::Result<()> {
    let _ = register_font("sans-serif", FontStyle::Normal, FONT);
    let top = 260 + 90 * rungs.len() as u32;
    let bottom = if scaling.is_empty() {
        0
    } else {
        120 + 72 * scaling.len() as u32
    };
    let (width, height) = (1600u32, top + bottom);
    let mut buf = vec![0u8; width as usize * height as usize * 3];
    draw(&mut buf, (width, height), top, title, rungs, scaling)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    image::RgbImage::from_raw(width, height, buf)
        .context("plot buffer size")?
        .save_with_format(path, image::ImageFormat::Png)
        .with_context(|| format!("writing {}", path.display()))
}

type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// A chart of `rows` labelled rows over `0..x_max`, its x axis described by `x_desc`.
fn rows_chart<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    x_max: f64,
    x_desc: &str,
    rows: f64,
) -> Result<
    ChartContext<
        'a,
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    String,
>
where
    DB::ErrorType: 'static,
{
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(36)
        .build_cartesian_2d(0f64..x_max, 0f64..rows)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .disable_y_axis()
        .x_desc(x_desc)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(chart)
}

/// The x axis of the wait-time charts.
const WAITING: &str = "% of each step spent waiting for data";

fn draw(
    buf: &mut [u8],
    size: (u32, u32),
    top: u32,
    title: &str,
    rungs: &[&RungResult],
    scaling: &[ScalingCell],
) -> DrawResult {
    let root = BitMapBackend::with_buffer(buf, size).into_drawing_area();
    root.fill(&WHITE)?;
    let (upper, lower) = root.split_vertically(top);
    if !scaling.is_empty() {
        draw_scaling(&lower, scaling)?;
    }
    let upper = upper.titled(title, ("sans-serif", 26))?;
    let (left, right) = upper.split_horizontally(620);
    let rows = rungs.len() as f64;
    let label = |r: &RungResult| r.name.clone();

    // Left: the wait-time ratio of each loader.
    let mut chart = rows_chart(
        &left,
        "wait-time ratio (steady state)",
        100.0,
        WAITING,
        rows,
    )?;
    for (i, r) in rungs.iter().enumerate() {
        let y = rows - i as f64 - 1.0;
        let ratio = 100.0 * r.wait_ratio();
        let color = if r.name.contains("feedstore") {
            FEEDSTORE
        } else {
            WAIT
        };
        chart.draw_series(std::iter::once(Rectangle::new(
            [(0.0, y + 0.12), (ratio.max(0.3), y + 0.5)],
            color.filled(),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            format!("{ratio:.1}%  ·  {:.1} samples/s", r.samples_per_sec()),
            (ratio.min(62.0) + 1.0, y + 0.42),
            ("sans-serif", 15),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            label(r),
            (1.0, y + 0.9),
            ("sans-serif", 15),
        )))?;
    }

    // Right: every step of every loader on one time axis.
    let longest = rungs
        .iter()
        .map(|r| {
            r.steps
                .first()
                .map_or(0.0, |s| s.iter().map(|(w, c)| w + c).sum::<f64>())
        })
        .fold(0.0, f64::max)
        .max(1e-3);
    let mut chart = rows_chart(
        &right,
        "per step: waiting for the batch (red) vs computing (blue), trainer rank 0",
        longest,
        "seconds since the loop started",
        rows,
    )?;
    for (i, r) in rungs.iter().enumerate() {
        let y = rows - i as f64 - 1.0;
        let Some(steps) = r.steps.first() else {
            continue;
        };
        let mut t = 0.0;
        let mut bars = Vec::with_capacity(2 * steps.len());
        for &(wait, compute) in steps {
            bars.push(Rectangle::new(
                [(t, y + 0.2), (t + wait, y + 0.7)],
                WAIT.filled(),
            ));
            t += wait;
            bars.push(Rectangle::new(
                [(t, y + 0.2), (t + compute, y + 0.7)],
                COMPUTE.filled(),
            ));
            t += compute;
        }
        chart.draw_series(bars)?;
        chart.draw_series(std::iter::once(Text::new(
            label(r),
            (longest * 0.005, y + 0.95),
            ("sans-serif", 14),
        )))?;
    }
    root.present()?;
    Ok(())
}

/// The scaling view: per setting, the copying loader's and feedstore's wait-time ratios.
fn draw_scaling<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    cells: &[ScalingCell],
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let rows = cells.len() as f64;
    let mut chart = rows_chart(
        area,
        "scaling: wait-time ratio of the prefetching loader with copies (red) and feedstore (green)",
        100.0,
        WAITING,
        rows,
    )?;
    for (i, c) in cells.iter().enumerate() {
        let y = rows - i as f64 - 1.0;
        chart.draw_series(std::iter::once(Text::new(
            c.label.clone(),
            (0.3, y + 0.97),
            ("sans-serif", 14),
        )))?;
        for (value, color, lo, hi) in [
            (c.copies, WAIT, 0.42, 0.68),
            (c.feedstore, FEEDSTORE, 0.1, 0.36),
        ] {
            let pct = 100.0 * value;
            chart.draw_series(std::iter::once(Rectangle::new(
                [(0.0, y + lo), (pct.max(0.3), y + hi)],
                color.filled(),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                format!("{pct:.1}%"),
                (pct + 0.8, y + hi - 0.05),
                ("sans-serif", 13),
            )))?;
        }
    }
    Ok(())
}

/// The multi-node picture: samples/s per placement at each scale, with the wait-time ratio and
/// the busiest node's link use beside each bar.
pub fn write_nodes(
    path: &Path,
    title: &str,
    runs: &[super::nodes::NodesRun],
) -> anyhow::Result<()> {
    let _ = register_font("sans-serif", FontStyle::Normal, FONT);
    let (width, height) = (1600u32, 200 + 70 * runs.len() as u32);
    let mut buf = vec![0u8; width as usize * height as usize * 3];
    draw_nodes(&mut buf, (width, height), title, runs).map_err(|e| anyhow::anyhow!("{e}"))?;
    image::RgbImage::from_raw(width, height, buf)
        .context("plot buffer size")?
        .save_with_format(path, image::ImageFormat::Png)
        .with_context(|| format!("writing {}", path.display()))
}

fn draw_nodes(
    buf: &mut [u8],
    size: (u32, u32),
    title: &str,
    runs: &[super::nodes::NodesRun],
) -> DrawResult {
    use super::nodes::Placement;
    let root = BitMapBackend::with_buffer(buf, size).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 24))?;
    let best = runs
        .iter()
        .map(super::nodes::NodesRun::rate)
        .fold(1.0, f64::max);
    let rows = runs.len() as f64;
    let mut chart = rows_chart(
        &root,
        "samples/s per placement and scale (green: spread + pull, red: colocated, grey: relay)",
        best * 1.45,
        "samples per second, all ranks",
        rows,
    )?;
    for (i, r) in runs.iter().enumerate() {
        let y = rows - i as f64 - 1.0;
        let color = match r.placement {
            Placement::Spread => FEEDSTORE,
            Placement::Colocated => WAIT,
            Placement::Relay => RGBColor(140, 140, 140),
        };
        let rate = r.rate();
        chart.draw_series(std::iter::once(Rectangle::new(
            [(0.0, y + 0.15), (rate.max(best * 0.002), y + 0.6)],
            color.filled(),
        )))?;
        let (node, busiest) = r.busiest();
        chart.draw_series(std::iter::once(Text::new(
            format!(
                "{} {}: {} ranks, batch {}, {rate:.1}/s, wait {:.1}%, busiest link node {node} {:.0}%",
                r.placement_name(),
                r.scale,
                r.ranks,
                r.batch,
                100.0 * r.result.wait_ratio(),
                100.0 * busiest
            ),
            (best * 0.01, y + 0.97),
            ("sans-serif", 15),
        )))?;
    }
    root.present()?;
    Ok(())
}
