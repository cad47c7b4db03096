//! Plots with plotters: latency against size (log-log) and throughput against outstanding
//! calls, and the streaming figures (ping-pong latency and goodput against size), each as SVG
//! and PNG.
//!
//! Text needs a font. plotters' default `ttf` feature finds system fonts through fontconfig
//! (a system package); instead the `ab_glyph` feature renders with a font we register: DejaVu
//! Sans, shipped inside the `dejavu` crate. Its licence (the Bitstream Vera licence and the
//! DejaVu changes placed in the public domain) allows embedding and redistribution with
//! software. So the PNGs carry their text on any machine, and the SVGs name `sans-serif`,
//! which every viewer has.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Result, anyhow};
use plotters::coord::Shift;
use plotters::coord::combinators::BindKeyPoints;
use plotters::prelude::*;

use crate::report::{Row, System, size_name};
use crate::stream_report::{StreamRatio, StreamRow};

pub(crate) const FONT: &str = "sans-serif";

pub(crate) fn register_font() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded DejaVu Sans font did not load"))
    }
}

fn color(s: System) -> RGBColor {
    match s {
        System::Rpc => RGBColor(0xd6, 0x27, 0x28),
        System::RpcPlain => RGBColor(0xff, 0x7f, 0x0e),
        System::RpcAsync => RGBColor(0x94, 0x67, 0xbd),
        System::TonicCt => RGBColor(0x1f, 0x77, 0xb4),
        System::TonicMt => RGBColor(0x2c, 0xa0, 0x2c),
        System::Raw => RGBColor(0x55, 0x55, 0x55),
    }
}

fn label(s: System, provider: &str) -> String {
    match s {
        System::Raw => format!("raw {provider} SEND/RECV"),
        other => other.name().to_string(),
    }
}

/// Writes `latency.{svg,png}` and `throughput.{svg,png}` into `dir`; returns the files.
///
/// # Errors
/// When a file cannot be written or the font cannot be loaded.
pub fn write_all(dir: &Path, rows: &[Row], provider: &str, title: &str) -> Result<Vec<PathBuf>> {
    register_font()?;
    std::fs::create_dir_all(dir)?;
    let mut files = Vec::new();
    let lat = |ext: &str| dir.join(format!("latency.{ext}"));
    let tput = |ext: &str| dir.join(format!("throughput.{ext}"));
    let size = (960, 620);
    latency(
        SVGBackend::new(&lat("svg"), size).into_drawing_area(),
        rows,
        provider,
        title,
    )?;
    latency(
        BitMapBackend::new(&lat("png"), size).into_drawing_area(),
        rows,
        provider,
        title,
    )?;
    files.extend([lat("svg"), lat("png")]);
    let size = (1200, 520);
    throughput(
        SVGBackend::new(&tput("svg"), size).into_drawing_area(),
        rows,
        provider,
        title,
    )?;
    throughput(
        BitMapBackend::new(&tput("png"), size).into_drawing_area(),
        rows,
        provider,
        title,
    )?;
    files.extend([tput("svg"), tput("png")]);
    Ok(files)
}

/// What the streaming plot shows: medians and ratios of a run.
#[derive(Clone, Copy, Debug)]
pub struct StreamPlot<'a> {
    /// Medians per system and size.
    pub rows: &'a [StreamRow],
    /// rdma-rpc against the best tonic, per size.
    pub ratios: &'a [StreamRatio],
    /// Messages in flight of the pipelined bidi phase (0: none).
    pub pipeline: usize,
}

/// Writes `streaming.{svg,png}` into `dir`: ping-pong round trips on one bidi call against
/// message size, streaming goodput against message size (server streaming, and bidi with
/// `pipeline` messages in flight), and how many times better rdma-rpc is than the best tonic
/// for each; returns the files.
///
/// # Errors
/// When a file cannot be written or the font cannot be loaded.
pub fn write_streaming(
    dir: &Path,
    data: StreamPlot<'_>,
    provider: &str,
    title: &str,
) -> Result<Vec<PathBuf>> {
    register_font()?;
    std::fs::create_dir_all(dir)?;
    let file = |ext: &str| dir.join(format!("streaming.{ext}"));
    let size = (1680, 560);
    streaming(
        SVGBackend::new(&file("svg"), size).into_drawing_area(),
        data,
        provider,
        title,
    )?;
    streaming(
        BitMapBackend::new(&file("png"), size).into_drawing_area(),
        data,
        provider,
        title,
    )?;
    Ok(vec![file("svg"), file("png")])
}

pub(crate) fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plot: {e:?}")
}

fn systems(rows: &[Row]) -> Vec<System> {
    let mut s: Vec<System> = rows.iter().map(|r| r.system).collect();
    s.sort();
    s.dedup();
    s
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| *v > 0.0 && v.is_finite())
        .fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return (1.0, 10.0);
    }
    // Whole decades around the data.
    (
        10f64.powf(lo.log10().floor()),
        10f64.powf(hi.log10().ceil()),
    )
}

fn latency<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    rows: &[Row],
    provider: &str,
    title: &str,
) -> Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let (xmin, xmax) = rows
        .iter()
        .map(|r| r.size as f64)
        .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let (xmin, xmax) = if xmin <= xmax {
        (xmin, xmax)
    } else {
        (1.0, 2.0)
    };
    let (ymin, ymax) = bounds(rows.iter().flat_map(|r| [r.p50_us, r.p99_us]).flatten());
    let mut ticks: Vec<f64> = rows.iter().map(|r| r.size as f64).collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Round-trip latency, 1 call outstanding: {title}"),
            (FONT, 20),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (xmin / 1.5..xmax * 1.5).log_scale().with_key_points(ticks),
            (ymin..ymax).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("payload bytes each way")
        .y_desc("µs (solid: p50, dashed: p99)")
        .x_label_formatter(&|v| size_name(v.round() as usize))
        .y_label_formatter(&|v| format!("{v}"))
        .label_style((FONT, 14))
        .draw()
        .map_err(err)?;
    for sys in systems(rows) {
        let c = color(sys);
        let mine: Vec<&Row> = rows.iter().filter(|r| r.system == sys).collect();
        let p50: Vec<(f64, f64)> = mine
            .iter()
            .filter_map(|r| Some((r.size as f64, r.p50_us?)))
            .collect();
        let p99: Vec<(f64, f64)> = mine
            .iter()
            .filter_map(|r| Some((r.size as f64, r.p99_us?)))
            .collect();
        chart
            .draw_series(LineSeries::new(p50.clone(), c.stroke_width(2)))
            .map_err(err)?
            .label(label(sys, provider))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(2)));
        chart
            .draw_series(p50.iter().map(|p| Circle::new(*p, 4, c.filled())))
            .map_err(err)?;
        chart
            .draw_series(DashedLineSeries::new(p99, 6, 4, c.stroke_width(1)))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

fn throughput<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    rows: &[Row],
    provider: &str,
    title: &str,
) -> Result<()> {
    root.fill(&WHITE).map_err(err)?;
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    // The smallest size, and 4 KiB (or the next one) when there is one.
    let mut panels: Vec<usize> = sizes.first().copied().into_iter().collect();
    if let Some(&s) = sizes.iter().find(|&&s| s == 4096).or(sizes.get(1)) {
        panels.push(s);
    }
    let (title_area, body) = root.split_vertically(36);
    title_area
        .titled(
            &format!("Calls per second against calls outstanding: {title}"),
            (FONT, 20),
        )
        .map_err(err)?;
    let areas = body.split_evenly((1, panels.len().max(1)));
    for (area, &size) in areas.iter().zip(&panels) {
        let here: Vec<&Row> = rows.iter().filter(|r| r.size == size).collect();
        let mut ks: Vec<usize> = here.iter().flat_map(|r| r.rates.keys().copied()).collect();
        ks.sort_unstable();
        ks.dedup();
        let kmax = ks.last().copied().unwrap_or(64).max(2) as f64;
        let ticks: Vec<f64> = ks.iter().map(|&k| k as f64).collect();
        let (ymin, ymax) = bounds(
            here.iter()
                .flat_map(|r| r.rates.values().map(|s| s.calls_per_s)),
        );
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{} calls", size_name(size)), (FONT, 16))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(
                (0.8..kmax * 1.25).log_scale().with_key_points(ticks),
                (ymin..ymax).log_scale(),
            )
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("calls outstanding")
            .y_desc("calls/s")
            .x_label_formatter(&|v| format!("{}", v.round()))
            .y_label_formatter(&|v| format!("{v:e}"))
            .label_style((FONT, 13))
            .draw()
            .map_err(err)?;
        for r in &here {
            let c = color(r.system);
            let pts: Vec<(f64, f64)> = r
                .rates
                .iter()
                .map(|(&k, s)| (k as f64, s.calls_per_s))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                .map_err(err)?
                .label(label(r.system, provider))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(2))
                });
            chart
                .draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Two series per system against message size on log-log axes: solid with dots, and dashed.
type Series = Vec<(System, Vec<(f64, f64)>, Vec<(f64, f64)>)>;

#[allow(clippy::too_many_arguments)]
fn size_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    y_desc: &str,
    sizes: &[f64],
    series: &Series,
    provider: &str,
    legend: SeriesLabelPosition,
) -> Result<()> {
    let (xmin, xmax) = match (sizes.first(), sizes.last()) {
        (Some(&a), Some(&b)) => (a, b),
        _ => (1.0, 2.0),
    };
    let (ymin, ymax) = bounds(
        series
            .iter()
            .flat_map(|(_, a, b)| a.iter().chain(b).map(|p| p.1)),
    );
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 16))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (xmin / 1.5..xmax * 1.5)
                .log_scale()
                .with_key_points(sizes.to_vec()),
            (ymin..ymax).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("payload bytes per message")
        .y_desc(y_desc)
        .x_label_formatter(&|v| size_name(v.round() as usize))
        .y_label_formatter(&|v| format!("{v}"))
        .label_style((FONT, 13))
        .draw()
        .map_err(err)?;
    for (sys, solid, dashed) in series {
        let c = color(*sys);
        chart
            .draw_series(LineSeries::new(solid.clone(), c.stroke_width(2)))
            .map_err(err)?
            .label(label(*sys, provider))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(2)));
        chart
            .draw_series(solid.iter().map(|p| Circle::new(*p, 4, c.filled())))
            .map_err(err)?;
        chart
            .draw_series(DashedLineSeries::new(
                dashed.clone(),
                6,
                4,
                c.stroke_width(1),
            ))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(legend)
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

fn streaming<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    data: StreamPlot<'_>,
    provider: &str,
    title: &str,
) -> Result<()> {
    let StreamPlot {
        rows,
        ratios,
        pipeline,
    } = data;
    root.fill(&WHITE).map_err(err)?;
    let mut sizes: Vec<f64> = rows.iter().map(|r| r.size as f64).collect();
    sizes.sort_by(f64::total_cmp);
    sizes.dedup();
    let mut systems: Vec<System> = rows.iter().map(|r| r.system).collect();
    systems.sort();
    systems.dedup();
    let pick = |sys: System, f: &dyn Fn(&StreamRow) -> Option<f64>| -> Vec<(f64, f64)> {
        rows.iter()
            .filter(|r| r.system == sys)
            .filter_map(|r| Some((r.size as f64, f(r)?)))
            .collect()
    };
    let latency: Series = systems
        .iter()
        .map(|&s| (s, pick(s, &|r| r.p50_us), pick(s, &|r| r.p99_us)))
        .collect();
    let goodput: Series = systems
        .iter()
        .map(|&s| {
            (
                s,
                pick(s, &|r| r.server_stream.map(|x| x.goodput_gbps)),
                pick(s, &|r| r.bidi.map(|x| x.goodput_gbps)),
            )
        })
        .collect();
    let (title_area, body) = root.split_vertically(36);
    title_area
        .titled(&format!("Streaming: {title}"), (FONT, 20))
        .map_err(err)?;
    let areas = body.split_evenly((1, 3));
    size_panel(
        &areas[0],
        "Ping-pong on one bidi call, per message",
        "µs (solid: p50, dashed: p99)",
        &sizes,
        &latency,
        provider,
        SeriesLabelPosition::UpperLeft,
    )?;
    let caption = if pipeline > 0 {
        format!("Goodput: server streaming (solid), bidi with {pipeline} in flight (dashed)")
    } else {
        "Goodput: server streaming".to_string()
    };
    size_panel(
        &areas[1],
        &caption,
        "GB/s of payload",
        &sizes,
        &goodput,
        provider,
        SeriesLabelPosition::UpperLeft,
    )?;
    ratio_panel(&areas[2], &sizes, ratios, pipeline)?;
    root.present().map_err(err)?;
    Ok(())
}

/// One figure of a [`StreamRatio`].
type RatioOf = fn(&StreamRatio) -> Option<f64>;

/// rdma-rpc against the best tonic per size, one line per figure, with the 1x line: above it
/// rdma-rpc is better.
fn ratio_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    sizes: &[f64],
    ratios: &[StreamRatio],
    pipeline: usize,
) -> Result<()> {
    let figures: [(String, RGBColor, RatioOf); 4] = [
        ("ping-pong p50".into(), RGBColor(0xd6, 0x27, 0x28), |r| {
            r.p50
        }),
        ("ping-pong p99".into(), RGBColor(0xff, 0x7f, 0x0e), |r| {
            r.p99
        }),
        (
            "server stream msg/s".into(),
            RGBColor(0x94, 0x67, 0xbd),
            |r| r.server_stream,
        ),
        (
            format!("bidi@{pipeline} msg/s"),
            RGBColor(0x17, 0xbe, 0xcf),
            |r| r.bidi,
        ),
    ];
    let (xmin, xmax) = match (sizes.first(), sizes.last()) {
        (Some(&a), Some(&b)) => (a, b),
        _ => (1.0, 2.0),
    };
    let (ymin, ymax) = bounds(
        ratios
            .iter()
            .flat_map(|r| figures.iter().filter_map(|f| (f.2)(r)))
            .chain([1.0]),
    );
    let mut chart = ChartBuilder::on(area)
        .caption(
            "rdma-rpc / best tonic (above 1: rdma-rpc better)",
            (FONT, 16),
        )
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (xmin / 1.5..xmax * 1.5)
                .log_scale()
                .with_key_points(sizes.to_vec()),
            (ymin..ymax).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("payload bytes per message")
        .y_desc("times better")
        .x_label_formatter(&|v| size_name(v.round() as usize))
        .y_label_formatter(&|v| format!("{v}x"))
        .label_style((FONT, 13))
        .draw()
        .map_err(err)?;
    chart
        .draw_series(LineSeries::new(
            [(xmin / 1.5, 1.0), (xmax * 1.5, 1.0)],
            BLACK.stroke_width(1),
        ))
        .map_err(err)?;
    for (name, c, f) in figures {
        if pipeline == 0 && name.starts_with("bidi") {
            continue;
        }
        let pts: Vec<(f64, f64)> = ratios
            .iter()
            .filter_map(|r| Some((r.size as f64, f(r)?)))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}
