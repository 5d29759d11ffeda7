//! A small SVG line chart (no dependencies): series of (x, y) points on
//! linear axes with ticks, labels and a legend — what `braid scale` draws
//! its scaling curve with.

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

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A "nice" step for about `n` ticks over `span`.
fn tick_step(span: f64, n: f64) -> f64 {
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

fn label(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        let m = format!("{:.2}", v / 1e6);
        format!("{}M", m.trim_end_matches('0').trim_end_matches('.'))
    } else if a >= 1e3 {
        format!("{:.0}k", v / 1e3)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

impl Chart {
    /// The chart as an SVG document (`w × h` pixels).
    pub fn svg(&self, w: f64, h: f64) -> String {
        let (l, r, t, b) = (80.0, 20.0, 40.0, 60.0);
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
        for &(x, y) in pts {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y1 = y1.max(y);
        }
        if !x0.is_finite() {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        let ys = tick_step(y1.max(1e-12), 5.0);
        let y1 = (y1 / ys).ceil().max(1.0) * ys;
        let px = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - r);
        let py = |y: f64| t + (1.0 - y / y1) * (h - t - b);
        let mut s = String::new();
        let _ = write!(
            s,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
             font-family=\"sans-serif\" font-size=\"12\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
            w / 2.0,
            esc(&self.title)
        );
        // Grid and y ticks.
        let mut y = 0.0;
        while y <= y1 + ys / 2.0 {
            let yy = py(y);
            let _ = writeln!(
                s,
                "<line x1=\"{l}\" y1=\"{yy:.1}\" x2=\"{:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                w - r,
                l - 6.0,
                yy + 4.0,
                label(y)
            );
            y += ys;
        }
        // x ticks at the data's x values.
        let mut xs: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .collect();
        xs.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
        xs.dedup();
        for x in xs {
            let xx = px(x);
            let _ = writeln!(
                s,
                "<line x1=\"{xx:.1}\" y1=\"{:.1}\" x2=\"{xx:.1}\" y2=\"{:.1}\" stroke=\"#999\"/>\
                 <text x=\"{xx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                h - b,
                h - b + 5.0,
                h - b + 20.0,
                label(x)
            );
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
            let _ = writeln!(
                s,
                "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"{dash}/>",
                path.join(" "),
                se.color
            );
            for &(x, y) in &se.points {
                let _ = writeln!(
                    s,
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3.5\" fill=\"{}\"/>",
                    px(x),
                    py(y),
                    se.color
                );
            }
            let ly = t + 14.0 + 18.0 * i as f64;
            let _ = writeln!(
                s,
                "<line x1=\"{:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{}\" stroke-width=\"2\"{dash}/>\
                 <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
                l + 12.0,
                l + 36.0,
                se.color,
                l + 42.0,
                ly + 4.0,
                esc(&se.name)
            );
        }
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
    }
}
