//! Small SVG charts (no dependencies): a line chart of series of (x, y)
//! points with ticks, labels and a legend — what `braid scale` draws its
//! scaling curve with, and `braid report --html` its plots — and a
//! timeline of coloured intervals in rows (the report's step timeline).

use std::fmt::Write as _;

/// One line of a chart.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// CSS colour.
    pub color: &'static str,
    /// Dashed (a reference line).
    pub dashed: bool,
    /// Points, in x order.
    pub points: Vec<(f64, f64)>,
}

/// A chart: title, axis labels, series.
pub struct Chart {
    /// Above the plot.
    pub title: String,
    /// Under the x axis.
    pub x_label: String,
    /// Beside the y axis.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
}

/// How the x axis is drawn.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub enum XAxis {
    /// Linear, a tick at every x value of the data.
    #[default]
    DataTicks,
    /// Linear, "nice" evenly spaced ticks (for many points).
    Linear,
    /// log2 of a size in bytes, ticks at powers of two labelled 1K, 64K, 1M…
    Log2Bytes,
}

/// How [`Chart::svg_with`] draws a chart; the default is [`Chart::svg`]'s.
#[derive(Default)]
pub struct Options {
    /// The x axis.
    pub x_axis: XAxis,
    /// The legend to the right of the plot rather than over its top left.
    pub legend_outside: bool,
    /// An x range shaded grey, with its label (e.g. warm-up steps).
    pub shade: Option<(f64, f64, String)>,
    /// Inline in an HTML page: no `xmlns`, and this `data-plot` attribute.
    pub data_plot: Option<&'static str>,
    /// Earlier series drawn wider, so that lines which coincide (ranks in
    /// lockstep) all stay visible.
    pub tapered: bool,
}

/// At most this many legend entries are drawn (then "+N more").
const LEGEND_MAX: usize = 12;
/// Series with more points than this are drawn without point markers.
const MARKERS_MAX: usize = 60;

pub(crate) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" step for about `n` ticks over `span`.
pub(crate) fn tick_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// A tick's value as short text: 0, 0.25, 500, 1.5k, 250k, 1.2M. Up to two
/// decimals are kept with a suffix, so the 1-2-5 steps of [`tick_step`]
/// keep their own value (1,500 is "1.5k", not "2k").
pub(crate) fn label(v: f64) -> String {
    let a = v.abs();
    let short = |x: f64, unit: &str| {
        let s = format!("{x:.2}");
        format!("{}{unit}", s.trim_end_matches('0').trim_end_matches('.'))
    };
    if a >= 1e6 {
        short(v / 1e6, "M")
    } else if a >= 1e3 {
        short(v / 1e3, "k")
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else if a >= 0.001 {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        format!("{v:.1e}")
    }
}

/// A size in bytes with a binary suffix: 512, 1K, 64K, 1M, 2G.
pub fn bytes_label(b: f64) -> String {
    let (v, unit) = if b >= (1u64 << 30) as f64 {
        (b / (1u64 << 30) as f64, "G")
    } else if b >= (1u64 << 20) as f64 {
        (b / (1u64 << 20) as f64, "M")
    } else if b >= 1024.0 {
        (b / 1024.0, "K")
    } else {
        (b, "")
    };
    let s = format!("{v:.1}");
    format!("{}{unit}", s.trim_end_matches('0').trim_end_matches('.'))
}

/// The opening `<svg>` tag, with a `<title>`.
fn open(w: f64, h: f64, title: &str, data_plot: Option<&str>) -> String {
    let ns = match data_plot {
        Some(p) => format!("data-plot=\"{p}\" role=\"img\""),
        None => "xmlns=\"http://www.w3.org/2000/svg\"".into(),
    };
    format!(
        "<svg {ns} width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<title>{}</title>\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        esc(title),
        w / 2.0,
        esc(title)
    )
}

/// Ticks (value, label, labelled) of an x axis over `[x0, x1]`.
fn x_ticks(axis: XAxis, xs: &[f64], x0: f64, x1: f64) -> Vec<(f64, String, bool)> {
    match axis {
        XAxis::DataTicks => xs.iter().map(|&x| (x, label(x), true)).collect(),
        XAxis::Linear => {
            let st = tick_step(x1 - x0, 8.0);
            // Whole multiples of the step (no running sum: 0.1 + 0.2 ≠ 0.3).
            let (k0, k1) = ((x0 / st).ceil() as i64, (x1 / st + 1e-9).floor() as i64);
            (k0..=k1)
                .map(|k| {
                    let x = k as f64 * st;
                    (x, label(x), true)
                })
                .collect()
        }
        XAxis::Log2Bytes => {
            let (a, b) = (x0.log2().floor() as i32, x1.log2().ceil() as i32);
            let stride = ((b - a) as f64 / 8.0).ceil().max(1.0) as i32;
            (a..=b)
                .map(|e| {
                    let v = 2f64.powi(e);
                    (v, bytes_label(v), (e - a) % stride == 0)
                })
                .collect()
        }
    }
}

impl Chart {
    /// The chart as an SVG document (`w × h` pixels).
    pub fn svg(&self, w: f64, h: f64) -> String {
        self.svg_with(w, h, &Options::default())
    }

    /// The chart as SVG (`w × h` pixels), drawn as `o` says.
    pub fn svg_with(&self, w: f64, h: f64, o: &Options) -> String {
        let log = o.x_axis == XAxis::Log2Bytes;
        let fx = |x: f64| if log { x.max(1e-300).log2() } else { x };
        let longest = self.series.iter().map(|s| s.name.chars().count()).max();
        let legend_w = (46.0 + 7.0 * longest.unwrap_or(0).min(30) as f64).min(260.0);
        let r = if o.legend_outside {
            20.0 + legend_w
        } else {
            20.0
        };
        let (l, t, b) = (80.0, 40.0, 60.0);
        let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
        for &(x, y) in self.series.iter().flat_map(|s| s.points.iter()) {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y1 = y1.max(y);
        }
        if !x0.is_finite() {
            (x0, x1) = if log { (1.0, 2.0) } else { (0.0, 1.0) };
        }
        if x1 <= x0 {
            x1 = if log { x0 * 2.0 } else { x0 + 1.0 };
        }
        let ys = tick_step(y1.max(1e-12), 5.0);
        let y1 = (y1 / ys).ceil().max(1.0) * ys;
        let (fx0, fx1) = (fx(x0), fx(x1));
        let px = |x: f64| l + (fx(x) - fx0) / (fx1 - fx0) * (w - l - r);
        let py = |y: f64| t + (1.0 - y / y1) * (h - t - b);
        let mut s = open(w, h, &self.title, o.data_plot);
        if let Some((a, z, text)) = &o.shade {
            let (xa, xz) = (px(a.max(x0)), px(z.min(x1)));
            if xz > xa {
                let _ = writeln!(
                    s,
                    "<rect x=\"{xa:.1}\" y=\"{t}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"#eee\"/>\
                     <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#777\">{}</text>",
                    xz - xa,
                    h - t - b,
                    (xa + xz) / 2.0,
                    h - b - 6.0,
                    esc(text)
                );
            }
        }
        // Grid and y ticks, at whole multiples of the step.
        for k in 0..=(y1 / ys).round() as i64 {
            let y = k as f64 * ys;
            let yy = py(y);
            let _ = writeln!(
                s,
                "<line x1=\"{l}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/>\
                 <text class=\"tick\" x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                w - r,
                l - 6.0,
                yy + 4.0,
                label(y)
            );
        }
        // x ticks.
        let mut xs: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .collect();
        xs.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
        xs.dedup();
        for (x, text, labelled) in x_ticks(o.x_axis, &xs, x0, x1) {
            let xx = px(x);
            let len = if labelled { 5.0 } else { 3.0 };
            let _ = write!(
                s,
                "<line x1=\"{xx:.1}\" y1=\"{:.1}\" x2=\"{xx:.1}\" y2=\"{:.1}\" stroke=\"#999\"/>",
                h - b,
                h - b + len,
            );
            if labelled {
                let _ = write!(
                    s,
                    "<text class=\"tick\" x=\"{xx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{text}</text>",
                    h - b + 20.0,
                );
            }
            s.push('\n');
        }
        let _ = write!(
            s,
            "<line x1=\"{l}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\
             <line x1=\"{l}\" y1=\"{t}\" x2=\"{l}\" y2=\"{:.1}\" stroke=\"black\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n\
             <text transform=\"translate(18 {:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
            h - b,
            w - r,
            h - b,
            h - b,
            (l + w - r) / 2.0,
            h - 18.0,
            esc(&self.x_label),
            (t + h - b) / 2.0,
            esc(&self.y_label)
        );
        let legend_x = if o.legend_outside {
            w - r + 10.0
        } else {
            l + 12.0
        };
        for (i, se) in self.series.iter().enumerate() {
            let path: Vec<String> = se
                .points
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let dash = if se.dashed {
                " stroke-dasharray=\"6 4\""
            } else {
                ""
            };
            let n = self.series.len();
            let width = if o.tapered && n > 1 {
                1.5 + 3.5 * (n - 1 - i) as f64 / (n - 1) as f64
            } else {
                2.0
            };
            let _ = writeln!(
                s,
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"{width:.1}\"{dash}/>",
                path.join(" "),
                se.color
            );
            if se.points.len() <= MARKERS_MAX {
                for &(x, y) in &se.points {
                    let _ = writeln!(
                        s,
                        "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3.5\" fill=\"{}\"/>",
                        px(x),
                        py(y),
                        se.color
                    );
                }
            }
            let ly = t + 14.0 + 18.0 * i as f64;
            if i + 1 == LEGEND_MAX && self.series.len() > LEGEND_MAX {
                let _ = writeln!(
                    s,
                    "<text x=\"{:.1}\" y=\"{:.1}\">+{} more</text>",
                    legend_x + 30.0,
                    ly + 4.0,
                    self.series.len() - i
                );
            }
            if i + 1 >= LEGEND_MAX && self.series.len() > LEGEND_MAX {
                continue;
            }
            let _ = writeln!(
                s,
                "<line x1=\"{:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{}\" stroke-width=\"2\"{dash}/>\
                 <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
                legend_x,
                legend_x + 24.0,
                se.color,
                legend_x + 30.0,
                ly + 4.0,
                esc(&se.name)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

/// One group of rows of a [`Timeline`] (one rank).
pub struct LaneGroup {
    /// Beside the group's first row.
    pub label: String,
    /// A faint background over this x range (e.g. the rank's own step).
    pub window: Option<(f64, f64)>,
    /// Per kind of [`Timeline::kinds`], its intervals (x units, any order).
    pub rows: Vec<Vec<(f64, f64)>>,
}

/// Coloured intervals in rows over a common x range: groups of rows, one
/// row per kind, with a legend and an x axis.
pub struct Timeline {
    /// Above the plot.
    pub title: String,
    /// Under the x axis.
    pub x_label: String,
    /// The x range drawn.
    pub span: (f64, f64),
    /// The kinds (row name, CSS colour), in row order.
    pub kinds: Vec<(String, &'static str)>,
    /// The groups, top to bottom.
    pub groups: Vec<LaneGroup>,
    /// At most about this many interval rectangles are drawn in all:
    /// intervals closer than a gap are merged, the gap doubling from one
    /// pixel until they fit.
    pub max_rects: usize,
}

/// `iv` in pixels (`to_px`), sorted and merged: intervals at most `gap`
/// pixels apart become one; each is at least one pixel wide.
fn pixel_rects(iv: &[(f64, f64)], to_px: &dyn Fn(f64) -> f64, gap: f64) -> Vec<(f64, f64)> {
    let mut px: Vec<(f64, f64)> = iv.iter().map(|&(a, b)| (to_px(a), to_px(b))).collect();
    px.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
    let mut out: Vec<(f64, f64)> = Vec::new();
    for (a, b) in px {
        let b = b.max(a + 1.0);
        match out.last_mut() {
            Some(last) if a - last.1 <= gap => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

impl Timeline {
    /// The timeline as inline SVG (`w` pixels wide; the height follows
    /// from the rows), with `data-plot="{data_plot}"`.
    pub fn svg(&self, w: f64, data_plot: &'static str) -> String {
        let (l, r, t, row, group_gap) = (150.0, 20.0, 64.0, 14.0, 12.0);
        let nk = self.kinds.len().max(1) as f64;
        let group_h = nk * row + group_gap;
        let plot_h = group_h * self.groups.len() as f64;
        let h = t + plot_h + 50.0;
        let (x0, x1) = (self.span.0, self.span.1.max(self.span.0 + 1e-9));
        let px = |x: f64| l + (x.clamp(x0, x1) - x0) / (x1 - x0) * (w - l - r);
        let mut s = open(w, h, &self.title, Some(data_plot));
        // Legend.
        let mut lx = l;
        for (name, color) in &self.kinds {
            let _ = writeln!(
                s,
                "<rect x=\"{lx:.1}\" y=\"34\" width=\"14\" height=\"12\" fill=\"{color}\"/>\
                 <text x=\"{:.1}\" y=\"44\">{}</text>",
                lx + 18.0,
                esc(name)
            );
            lx += 30.0 + 7.0 * name.chars().count() as f64;
        }
        // Each group's own window, under the grid.
        for (gi, g) in self.groups.iter().enumerate() {
            if let Some((a, b)) = g.window {
                let _ = writeln!(
                    s,
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"#f0f0f0\"/>",
                    px(a),
                    t + gi as f64 * group_h - 2.0,
                    (px(b) - px(a)).max(1.0),
                    nk * row + 4.0
                );
            }
        }
        // Ticks and grid, whole multiples of the step from the span's start.
        let st = tick_step(x1 - x0, 10.0);
        for k in 0..=((x1 - x0) / st + 1e-9).floor() as i64 {
            let x = x0 + k as f64 * st;
            let xx = px(x);
            let _ = writeln!(
                s,
                "<line x1=\"{xx:.1}\" y1=\"{t}\" x2=\"{xx:.1}\" y2=\"{:.1}\" stroke=\"#d8d8d8\"/>\
                 <text class=\"tick\" x=\"{xx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                t + plot_h,
                t + plot_h + 16.0,
                label(k as f64 * st)
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
            (l + w - r) / 2.0,
            h - 10.0,
            esc(&self.x_label)
        );
        // Rows: merge until the rectangles fit the budget.
        let mut gap = 1.0;
        let rects = loop {
            let rects: Vec<Vec<Vec<(f64, f64)>>> = self
                .groups
                .iter()
                .map(|g| g.rows.iter().map(|iv| pixel_rects(iv, &px, gap)).collect())
                .collect();
            let n: usize = rects.iter().flatten().map(Vec::len).sum();
            if n <= self.max_rects || gap > w {
                break rects;
            }
            gap *= 2.0;
        };
        for (gi, (g, rows)) in self.groups.iter().zip(&rects).enumerate() {
            let gy = t + gi as f64 * group_h;
            let _ = writeln!(
                s,
                "<text x=\"8\" y=\"{:.1}\" font-weight=\"bold\">{}</text>",
                gy + row - 3.0,
                esc(&g.label)
            );
            for (k, (name, color)) in self.kinds.iter().enumerate() {
                let ry = gy + k as f64 * row;
                let _ = writeln!(
                    s,
                    "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" font-size=\"10\" fill=\"#555\">{}</text>",
                    l - 6.0,
                    ry + row - 4.0,
                    esc(name)
                );
                let Some(row_rects) = rows.get(k) else {
                    continue;
                };
                let _ = write!(s, "<g fill=\"{color}\">");
                for &(a, b) in row_rects {
                    let _ = write!(
                        s,
                        "<rect x=\"{a:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\"/>",
                        ry + 1.0,
                        b - a,
                        row - 2.0
                    );
                }
                s.push_str("</g>\n");
            }
        }
        let _ = writeln!(
            s,
            "<line x1=\"{l}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"black\"/>",
            t + plot_h,
            w - r,
            t + plot_h
        );
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_hold_their_points_and_escape_text() {
        let c = Chart {
            title: "a <b> & c".into(),
            x_label: "workers".into(),
            y_label: "tokens/s".into(),
            series: vec![Series {
                name: "braid".into(),
                color: "#1f77b4",
                dashed: false,
                points: vec![(1.0, 1000.0), (2.0, 1900.0)],
            }],
        };
        let svg = c.svg(640.0, 400.0);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("a &lt;b&gt; &amp; c"));
        assert_eq!(svg.matches("<circle").count(), 2);
        assert_eq!(tick_step(1900.0, 5.0), 500.0);
        assert_eq!(label(2_500_000.0), "2.5M");
        // Every tick keeps its value: 1,500 was drawn as "2k".
        assert_eq!(label(1500.0), "1.5k");
        assert_eq!(label(250_000.0), "250k");
        assert_eq!(label(0.6000000000000001), "0.6");
        assert_eq!(label(0.015), "0.015");
        let ticks: Vec<&str> = svg
            .split("<text class=\"tick\"")
            .skip(1)
            .map(|t| &t[t.find('>').unwrap() + 1..t.find("</text>").unwrap()])
            .collect();
        assert_eq!(ticks, ["0", "500", "1k", "1.5k", "2k", "1", "2"]);
    }

    #[test]
    fn log2_axes_label_sizes_in_bytes() {
        assert_eq!(bytes_label(1024.0), "1K");
        assert_eq!(bytes_label(65536.0), "64K");
        assert_eq!(bytes_label((1u64 << 26) as f64), "64M");
        assert_eq!(bytes_label(1536.0), "1.5K");
        let c = Chart {
            title: "busbw".into(),
            x_label: "bytes".into(),
            y_label: "GB/s".into(),
            series: vec![Series {
                name: "shm".into(),
                color: "#1f77b4",
                dashed: false,
                points: (10..=22).map(|e| (2f64.powi(e), e as f64)).collect(),
            }],
        };
        let o = Options {
            x_axis: XAxis::Log2Bytes,
            data_plot: Some("busbw"),
            ..Default::default()
        };
        let svg = c.svg_with(600.0, 300.0, &o);
        assert!(svg.starts_with("<svg data-plot=\"busbw\"") && !svg.contains("xmlns"));
        for l in [">1K<", ">64K<", ">1M<", ">4M<"] {
            assert!(svg.contains(l), "{l}");
        }
    }

    #[test]
    fn timelines_merge_rects_to_their_budget() {
        let tiny: Vec<(f64, f64)> = (0..100_000)
            .map(|i| (i as f64 * 3.0, i as f64 * 3.0 + 1.0))
            .collect();
        let t = Timeline {
            title: "t".into(),
            x_label: "ms".into(),
            span: (0.0, 300_000.0),
            kinds: vec![("a".into(), "red"), ("b".into(), "blue")],
            groups: (0..4)
                .map(|g| LaneGroup {
                    label: format!("rank {g}"),
                    window: None,
                    rows: vec![tiny.clone(), vec![(10.0, 20.0), (1e5, 2e5)]],
                })
                .collect(),
            max_rects: 50,
        };
        let svg = t.svg(800.0, "timeline");
        let rects = svg.matches("<rect").count();
        assert!(rects < 70, "{rects}");
    }
}
