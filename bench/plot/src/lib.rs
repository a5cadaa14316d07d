//! `bex-plot`: the SVG line charts of the benchmark tools (`alloc-bench`, `bex-perf`),
//! written by hand — a few hundred bytes of markup per chart do not justify a plotting
//! dependency.
//!
//! A [`Chart`] is a titled panel of coloured [`Series`] (polylines with point markers when
//! short); [`chart`] draws one at a given position into an SVG body, [`svg_doc`] wraps bodies
//! into a document, [`grid`] lays panels out in rows. The y axis always starts at 0 and ends
//! at a "nice" value; the x axis is linear over the data, with integer ticks for short integer
//! ranges or the caller's own ticks ([`Chart::x_ticks`], e.g. sizes on a log₂ axis made with
//! [`log2_ticks`]).
#![forbid(unsafe_code)]

use std::fmt::Write as _;

/// The colour cycle (matplotlib's first five, then near-black).
pub const COLORS: [&str; 6] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#111111"];

/// A named, coloured line of (x, y) points.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Stroke colour (any SVG colour).
    pub color: String,
    /// The points, in drawing order.
    pub points: Vec<(f64, f64)>,
    /// Draw dashed (e.g. a P99 next to its mean).
    pub dashed: bool,
}

impl Series {
    /// A solid series.
    pub fn new(name: impl Into<String>, color: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series { name: name.into(), color: color.into(), points, dashed: false }
    }

    /// The same series, dashed.
    pub fn dashed(mut self) -> Self {
        self.dashed = true;
        self
    }
}

/// One line chart.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    /// Title above the plot area.
    pub title: String,
    /// Label under the x axis.
    pub x_label: String,
    /// Label left of the y axis (rotated).
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
    /// Tick positions and labels of the x axis; `None`: integers for a short integer range,
    /// else six evenly spaced values.
    pub x_ticks: Option<Vec<(f64, String)>>,
}

impl Chart {
    /// A chart with automatic x ticks.
    pub fn new(
        title: impl Into<String>,
        x_label: impl Into<String>,
        y_label: impl Into<String>,
        series: Vec<Series>,
    ) -> Chart {
        Chart {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            series,
            x_ticks: None,
        }
    }

    /// The same chart with the given x ticks.
    pub fn with_x_ticks(mut self, ticks: Vec<(f64, String)>) -> Chart {
        self.x_ticks = Some(ticks);
        self
    }
}

/// The smallest step of 1, 2 or 5 × a power of ten that is at least `raw` (1 for `raw ≤ 0`).
pub fn step_125(raw: f64) -> f64 {
    if raw <= 0.0 || !raw.is_finite() {
        return 1.0;
    }
    let p = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        // A relative tolerance: 0.3 / 0.1 is 2.9999999999999996.
        if m * p >= raw * (1.0 - 1e-9) {
            return m * p;
        }
    }
    10.0 * p
}

/// Decimals that print every multiple of a 1-2-5 `step` exactly (0.5 → 1, 0.05 → 2, 20 → 0).
fn step_decimals(step: f64) -> usize {
    (-step.log10().floor()).max(0.0) as usize
}

/// The multiples of `step` in `lo..=hi`, labelled with the decimals `step` needs.
fn ticks_within(lo: f64, hi: f64, step: f64) -> Vec<(f64, String)> {
    let decimals = step_decimals(step);
    // The tolerance keeps ends that are multiples up to rounding (0.3 / 0.1).
    let first = (lo / step - 1e-9).ceil() as i64;
    let last = (hi / step + 1e-9).floor() as i64;
    (first..=last)
        .map(|i| i as f64 * step)
        // -0.0 would print as "-0.0".
        .map(|v| (v, format!("{:.*}", decimals, if v == 0.0 { 0.0 } else { v })))
        .collect()
}

/// How values map onto one axis of a chart.
#[derive(Clone, Debug, PartialEq)]
enum Scale {
    /// `lo..hi` linear, ticks every `step` (1-2-5) from `lo`.
    Linear { lo: f64, hi: f64, step: f64 },
    /// `lo..hi` (powers of ten) logarithmic, a tick per decade.
    Log10 { lo: f64, hi: f64 },
}

impl Scale {
    /// A linear scale from `lo` covering `hi` in at most `intervals` 1-2-5 steps.
    fn linear(lo: f64, hi: f64, intervals: usize) -> Scale {
        let step = step_125((hi - lo) / intervals.max(1) as f64);
        let lo = (lo / step).floor() * step;
        let hi = ((hi / step).ceil() * step).max(lo + step);
        Scale::Linear { lo, hi, step }
    }

    /// The y scale of values `ys`: logarithmic when all are positive and they span two
    /// decades or more (a linear axis would flatten the small ones to zero), else linear
    /// from 0.
    fn for_values(ys: &[f64]) -> Scale {
        let (mut min, mut max) = (f64::MAX, 0f64);
        for &y in ys.iter().filter(|y| y.is_finite()) {
            min = min.min(y);
            max = max.max(y);
        }
        if min > 0.0 && max / min >= 100.0 {
            let lo = 10f64.powf(min.log10().floor());
            let hi = 10f64.powf(max.log10().ceil());
            return Scale::Log10 { lo, hi };
        }
        Scale::linear(0.0, (max * 1.05).max(f64::MIN_POSITIVE), 5)
    }

    /// Position of `v` in 0..=1 along the axis (log: non-positive values clamp to 0).
    fn unit(&self, v: f64) -> f64 {
        match *self {
            Scale::Linear { lo, hi, .. } => (v - lo) / (hi - lo),
            Scale::Log10 { lo, hi } => {
                if v <= 0.0 {
                    0.0
                } else {
                    (v.log10() - lo.log10()) / (hi.log10() - lo.log10())
                }
            }
        }
    }

    /// Tick values and their labels.
    fn ticks(&self) -> Vec<(f64, String)> {
        match *self {
            Scale::Linear { lo, hi, step } => ticks_within(lo, hi, step),
            Scale::Log10 { lo, hi } => {
                let (a, b) = (lo.log10().round() as i32, hi.log10().round() as i32);
                (a..=b)
                    .map(|e| (10f64.powi(e), format!("{:.*}", (-e).max(0) as usize, 10f64.powi(e))))
                    .collect()
            }
        }
    }
}

/// Draws `c` into `o` with its top-left corner at (`x0`, `y0`), `w`×`h` pixels. `legend`
/// lists the series names in a column right of the plot area, never over the data. The y axis
/// is logarithmic when the values are positive and span two decades or more, else linear
/// from 0; ticks step by 1, 2 or 5 × a power of ten and are labelled exactly.
pub fn chart(o: &mut String, c: &Chart, x0: f64, y0: f64, w: f64, h: f64, legend: bool) {
    let legend_w = if legend {
        let chars = c.series.iter().map(|s| s.name.chars().count()).max().unwrap_or(0);
        (30.0 + 6.5 * chars as f64).min(w * 0.45)
    } else {
        0.0
    };
    let (pl, pr, pt, pb) = (60.0, 10.0 + legend_w, 28.0, 40.0);
    let (iw, ih) = (w - pl - pr, h - pt - pb);
    let pts = c.series.iter().flat_map(|s| s.points.iter());
    let (mut xmin, mut xmax) = (f64::MAX, f64::MIN);
    let mut ys = Vec::new();
    for &(x, y) in pts {
        xmin = xmin.min(x);
        xmax = xmax.max(x);
        ys.push(y);
    }
    if let Some(ticks) = &c.x_ticks {
        for &(x, _) in ticks {
            xmin = xmin.min(x);
            xmax = xmax.max(x);
        }
    }
    if xmin > xmax {
        (xmin, xmax) = (0.0, 1.0);
    }
    if xmax == xmin {
        xmax = xmin + 1.0;
    }
    let yscale = Scale::for_values(&ys);
    let px = |x: f64| x0 + pl + (x - xmin) / (xmax - xmin) * iw;
    let py = |y: f64| y0 + pt + ih - yscale.unit(y) * ih;
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" font-size="14" text-anchor="middle" font-weight="bold">{}</text>"#,
        x0 + pl + iw / 2.0,
        y0 + 18.0,
        escape(&c.title)
    );
    let _ = writeln!(
        o,
        r##"<rect x="{:.1}" y="{:.1}" width="{iw:.1}" height="{ih:.1}" fill="none" stroke="#888"/>"##,
        x0 + pl,
        y0 + pt
    );
    for (y, label) in yscale.ticks() {
        let _ = writeln!(
            o,
            r##"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{}</text>"##,
            x0 + pl,
            py(y),
            x0 + pl + iw,
            py(y),
            x0 + pl - 4.0,
            py(y) + 4.0,
            label
        );
    }
    let xt: Vec<(f64, String)> = match &c.x_ticks {
        Some(t) => t.clone(),
        None if xmax - xmin <= 16.0 && xmin.fract() == 0.0 && xmax.fract() == 0.0 => {
            (xmin as i64..=xmax as i64).map(|v| (v as f64, v.to_string())).collect()
        }
        None => ticks_within(xmin, xmax, step_125((xmax - xmin) / 5.0)),
    };
    for (x, label) in xt {
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
            px(x),
            y0 + pt + ih + 14.0,
            escape(&label)
        );
    }
    let log_note = if matches!(yscale, Scale::Log10 { .. }) { " (log scale)" } else { "" };
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#,
        x0 + pl + iw / 2.0,
        y0 + h - 8.0,
        escape(&c.x_label)
    );
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle" transform="rotate(-90 {:.1} {:.1})">{}{log_note}</text>"#,
        x0 + 14.0,
        y0 + pt + ih / 2.0,
        x0 + 14.0,
        y0 + pt + ih / 2.0,
        escape(&c.y_label)
    );
    for (i, s) in c.series.iter().enumerate() {
        if s.points.is_empty() {
            continue;
        }
        let color = &s.color;
        let dash = if s.dashed { r#" stroke-dasharray="6 4""# } else { "" };
        let d: Vec<String> =
            s.points.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
            d.join(" ")
        );
        if s.points.len() <= 16 {
            for &(x, y) in &s.points {
                let _ = writeln!(
                    o,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                    px(x),
                    py(y)
                );
            }
        }
        if legend {
            let ly = y0 + pt + 10.0 + i as f64 * 15.0;
            let lx = x0 + pl + iw + 10.0;
            let _ = writeln!(
                o,
                r#"<line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="2"{dash}/><text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
                ly - 4.0,
                lx + 18.0,
                ly - 4.0,
                lx + 22.0,
                ly,
                escape(&s.name)
            );
        }
    }
}

/// A value as a short label: at most four decimals, trailing zeros dropped (1.25 → "1.25",
/// 250 → "250", 0.1 + 0.2 → "0.3").
pub fn fmt_tick(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// A byte count as a short label: `512`, `4K`, `1M`.
pub fn fmt_bytes(v: u64) -> String {
    if v >= 1 << 20 && v % (1 << 20) == 0 {
        format!("{}M", v >> 20)
    } else if v >= 1 << 10 && v % (1 << 10) == 0 {
        format!("{}K", v >> 10)
    } else {
        v.to_string()
    }
}

/// Ticks for a log₂ x axis (plot `log2(v)` as x): one per value, labelled by `label`.
pub fn log2_ticks(values: &[u64], label: impl Fn(u64) -> String) -> Vec<(f64, String)> {
    values.iter().filter(|&&v| v > 0).map(|&v| ((v as f64).log2(), label(v))).collect()
}

/// Wraps a body of SVG elements into a `w`×`h` document with a white background.
pub fn svg_doc(w: f64, h: f64, body: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n{body}</svg>\n"
    )
}

/// Charts in rows of `cols` panels of `w`×`h` pixels, legends on every panel, as a document.
pub fn grid(charts: &[Chart], cols: usize, w: f64, h: f64) -> String {
    let cols = cols.max(1);
    let rows = charts.len().div_ceil(cols).max(1);
    let mut body = String::new();
    for (i, c) in charts.iter().enumerate() {
        chart(&mut body, c, (i % cols) as f64 * w, (i / cols) as f64 * h, w, h, true);
    }
    svg_doc(cols.min(charts.len().max(1)) as f64 * w, rows as f64 * h, &body)
}

/// Escapes text for SVG content (`&`, `<`, `>`).
fn escape(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains(['&', '<', '>']) {
        s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").into()
    } else {
        s.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_step_by_1_2_5_and_are_labelled_exactly() {
        assert_eq!(step_125(0.3 / 0.1), 5.0);
        assert_eq!(step_125(0.24), 0.5);
        assert_eq!(step_125(3.0), 5.0);
        assert_eq!(step_125(20.0), 20.0);
        // 0..1.3 in at most 5 steps: 0.5 apart, labels with one decimal.
        let t = Scale::linear(0.0, 1.3, 5).ticks();
        let labels: Vec<&str> = t.iter().map(|(_, l)| l.as_str()).collect();
        assert_eq!(labels, ["0.0", "0.5", "1.0", "1.5"]);
        let t = Scale::linear(0.0, 0.26, 5).ticks();
        let labels: Vec<&str> = t.iter().map(|(_, l)| l.as_str()).collect();
        assert_eq!(labels, ["0.0", "0.1", "0.2", "0.3"]);
        let t = Scale::linear(0.0, 0.0124, 5).ticks();
        assert_eq!(t[1].1, "0.005", "a 0.005 step prints three decimals");
        assert_eq!(Scale::linear(0.0, 230.0, 5).ticks().len(), 6, "0, 50, ..., 250");
    }

    #[test]
    fn values_spanning_decades_get_a_log_axis() {
        let s = Scale::for_values(&[3.0, 40.0, 9000.0]);
        assert_eq!(s, Scale::Log10 { lo: 1.0, hi: 10_000.0 });
        let labels: Vec<String> = s.ticks().into_iter().map(|(_, l)| l).collect();
        assert_eq!(labels, ["1", "10", "100", "1000", "10000"]);
        assert!((s.unit(100.0) - 0.5).abs() < 1e-12);
        let small = Scale::for_values(&[0.002, 0.5]);
        assert_eq!(small.ticks()[0].1, "0.001");
        // A zero, or less than two decades: linear from 0.
        assert!(matches!(Scale::for_values(&[0.0, 9000.0]), Scale::Linear { lo, .. } if lo == 0.0));
        assert!(matches!(Scale::for_values(&[5.0, 90.0]), Scale::Linear { .. }));
    }

    #[test]
    fn labels() {
        assert_eq!(fmt_tick(0.0), "0");
        assert_eq!(fmt_tick(250.0), "250");
        assert_eq!(fmt_tick(2.5), "2.5");
        assert_eq!(fmt_tick(1.25), "1.25");
        assert_eq!(fmt_tick(0.1 + 0.2), "0.3");
        assert_eq!(fmt_tick(0.25), "0.25");
        assert_eq!(fmt_bytes(512), "512");
        assert_eq!(fmt_bytes(4096), "4K");
        assert_eq!(fmt_bytes(1 << 20), "1M");
        assert_eq!(fmt_bytes(1536), "1536");
        let t = log2_ticks(&[32, 1024, 0], fmt_bytes);
        assert_eq!(t, vec![(5.0, "32".to_string()), (10.0, "1K".to_string())]);
    }

    #[test]
    fn a_chart_has_its_series_ticks_and_escaped_text() {
        let c = Chart::new(
            "RTT <µs>",
            "size",
            "µs",
            vec![
                Series::new("a & b", COLORS[0], vec![(5.0, 1.0), (10.0, 3.0)]),
                Series::new("p99", COLORS[1], vec![(5.0, 2.0)]).dashed(),
                Series::new("empty", COLORS[2], vec![]),
            ],
        )
        .with_x_ticks(log2_ticks(&[32, 1024], fmt_bytes));
        let svg = grid(&[c.clone(), c], 2, 300.0, 200.0);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains(r#"width="600" height="200""#), "{svg}");
        assert!(svg.contains("RTT &lt;µs&gt;") && svg.contains("a &amp; b"));
        assert_eq!(svg.matches("<polyline").count(), 4, "empty series are not drawn");
        assert_eq!(svg.matches("stroke-dasharray").count(), 4, "line and legend, twice");
        assert!(svg.contains(">1K</text>"));
        // The legend sits right of the plot area: every legend line starts past it.
        let plot_right = 60.0 + (300.0 - 60.0 - (10.0 + 30.0 + 6.5 * 5.0));
        let legend_x: Vec<f64> = svg
            .lines()
            .filter(|l| l.starts_with("<line") && l.contains("stroke-width=\"2\""))
            .filter_map(|l| l.split("x1=\"").nth(1)?.split('"').next()?.parse().ok())
            .collect();
        assert_eq!(legend_x.len(), 4, "two drawn series' legend lines, twice: {legend_x:?}");
        assert!(legend_x.iter().all(|&x| x % 300.0 > plot_right), "{legend_x:?} vs {plot_right}");
    }
}
