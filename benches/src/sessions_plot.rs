//! The plot of `rpc-bench sessions`: connect + first call latency, and server memory per
//! connection, against the connections actually open, both systems; SVG and PNG.

use std::path::{Path, PathBuf};

use anyhow::Result;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::plot::{FONT, err, register_font};
use crate::sessions::{Cell, Report};
use crate::sessions_client::SessionSystem;

/// A panel: caption, unit, and the figure of a cell it shows.
type Panel = (&'static str, &'static str, fn(&Cell) -> Option<f64>);

fn color(s: SessionSystem) -> RGBColor {
    match s {
        SessionSystem::Rpc => RGBColor(0xd6, 0x27, 0x28),
        SessionSystem::Tonic => RGBColor(0x1f, 0x77, 0xb4),
    }
}

/// Writes `<base>.svg` and `<base>.png`; returns them.
///
/// # Errors
/// When a file cannot be written or the font cannot be loaded.
pub fn write(base: &Path, report: &Report) -> Result<Vec<PathBuf>> {
    register_font()?;
    let file = |ext: &str| base.with_extension(ext);
    let size = (1280, 520);
    draw(
        SVGBackend::new(&file("svg"), size).into_drawing_area(),
        report,
    )?;
    draw(
        BitMapBackend::new(&file("png"), size).into_drawing_area(),
        report,
    )?;
    Ok(vec![file("svg"), file("png")])
}

/// (connections open, value) of `sys`'s cells that have both.
fn points(
    report: &Report,
    sys: SessionSystem,
    f: impl Fn(&Cell) -> Option<f64>,
) -> Vec<(f64, f64)> {
    report
        .cells
        .iter()
        .filter(|c| c.system == sys && c.opened > 0)
        .filter_map(|c| Some((c.opened as f64, f(c)?)))
        .collect()
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, report: &Report) -> Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let (title, body) = root.split_vertically(36);
    title
        .titled(
            &format!(
                "Many connections to one server, one shard ({})",
                report.machine
            ),
            (FONT, 18),
        )
        .map_err(err)?;
    let areas = body.split_evenly((1, 2));
    let mut systems: Vec<SessionSystem> = report.cells.iter().map(|c| c.system).collect();
    systems.dedup();
    let panels: [Panel; 2] = [
        ("Connect + first 32 B call, p50", "µs", |c| {
            c.connect_first_call.map(|q| q.p50_us)
        }),
        (
            "Server memory per idle connection (VmRSS incl. shared)",
            "KiB",
            |c| c.server_kib_per_conn.filter(|v| *v > 0.0),
        ),
    ];
    for (area, (caption, unit, f)) in areas.iter().zip(panels) {
        let all: Vec<(f64, f64)> = systems.iter().flat_map(|&s| points(report, s, f)).collect();
        let xmax = all.iter().map(|p| p.0).fold(10.0, f64::max) * 2.0;
        let (lo, hi) = all
            .iter()
            .map(|p| p.1)
            .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
        let (lo, hi) = if lo <= hi {
            (lo / 2.0, hi * 2.0)
        } else {
            (1.0, 10.0)
        };
        let mut chart = ChartBuilder::on(area)
            .caption(caption, (FONT, 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((0.7..xmax).log_scale(), (lo..hi).log_scale())
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("connections open")
            .y_desc(unit)
            .x_label_formatter(&|v| format!("{}", v.round()))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .y_labels(8)
            .light_line_style(RGBColor(0xf0, 0xf0, 0xf0))
            .label_style((FONT, 13))
            .draw()
            .map_err(err)?;
        for &sys in &systems {
            let c = color(sys);
            let pts = points(report, sys, f);
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(err)?
                .label(sys.name())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(2))
                });
            chart
                .draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
