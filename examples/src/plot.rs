//! `--plot FILE.svg`: charts of a sweep against message size (log scale), one panel per
//! quantity, each with the measured series and its reference. Plain SVG text: no plotting
//! crate, because their text rendering needs font libraries on the machine, and the charts
//! are a few lines and polylines.
use std::fmt::Write as _;

/// One line of a panel.
pub struct Series<'a> {
    /// Legend text.
    pub name: &'a str,
    /// CSS colour.
    pub color: &'a str,
    /// (x, y) points, x > 0.
    pub points: Vec<(f64, f64)>,
}

/// One chart.
pub struct Panel<'a> {
    /// Y-axis label.
    pub y_label: &'a str,
    /// Its lines.
    pub series: Vec<Series<'a>>,
}

const W: f64 = 760.0;
const PANEL_H: f64 = 300.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 50.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A size on the x axis: B, KiB, MiB.
fn size_label(x: f64) -> String {
    let x = x as u64;
    match x {
        x if x >= 1 << 20 => format!("{}M", x >> 20),
        x if x >= 1 << 10 => format!("{}K", x >> 10),
        x => x.to_string(),
    }
}

/// The SVG document: `title` on top, then the panels stacked, sharing the x range.
pub fn svg(title: &str, x_label: &str, panels: &[Panel<'_>]) -> String {
    let xs: Vec<f64> = panels
        .iter()
        .flat_map(|p| p.series.iter().flat_map(|s| s.points.iter().map(|pt| pt.0)))
        .filter(|x| *x > 0.0)
        .collect();
    let (x0, x1) = xs.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let (lx0, lx1) = if xs.is_empty() {
        (0.0, 1.0)
    } else {
        (x0.log2().floor(), x1.log2().ceil().max(x0.log2().floor() + 1.0))
    };
    let height = TOP + panels.len() as f64 * (PANEL_H + BOTTOM) + 10.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        W / 2.0,
        esc(title)
    );
    let plot_w = W - LEFT - RIGHT;
    for (i, panel) in panels.iter().enumerate() {
        let top = TOP + i as f64 * (PANEL_H + BOTTOM);
        let ymax = panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold(0.0f64, f64::max)
            .max(1e-12)
            * 1.08;
        let px = |x: f64| LEFT + (x.log2() - lx0) / (lx1 - lx0) * plot_w;
        let py = |y: f64| top + PANEL_H - y / ymax * PANEL_H;
        let _ = writeln!(
            out,
            r##"<rect x="{LEFT}" y="{top}" width="{plot_w}" height="{PANEL_H}" fill="none" stroke="#444"/>"##
        );
        // Y grid: 5 steps.
        for k in 0..=5 {
            let y = ymax * k as f64 / 5.0;
            let yy = py(y);
            let _ = writeln!(
                out,
                r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + plot_w,
                LEFT - 6.0,
                yy + 4.0,
                fmt_num(y)
            );
        }
        // X ticks: every power of two, labelled every other one when crowded.
        let every = if lx1 - lx0 > 12.0 { 2 } else { 1 };
        for (n, b) in (lx0 as i64..=lx1 as i64).enumerate() {
            let xx = px(2f64.powi(b as i32));
            let _ = writeln!(
                out,
                r##"<line x1="{xx:.1}" y1="{top}" x2="{xx:.1}" y2="{:.1}" stroke="#eee"/>"##,
                top + PANEL_H
            );
            if n % every == 0 {
                let _ = writeln!(
                    out,
                    r#"<text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                    top + PANEL_H + 16.0,
                    size_label(2f64.powi(b as i32))
                );
            }
        }
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + plot_w / 2.0,
            top + PANEL_H + 34.0,
            esc(x_label)
        );
        let _ = writeln!(
            out,
            r#"<text transform="translate(16,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            top + PANEL_H / 2.0,
            esc(panel.y_label)
        );
        for (k, s) in panel.series.iter().enumerate() {
            let pts: Vec<String> = s
                .points
                .iter()
                .filter(|p| p.0 > 0.0 && p.1.is_finite())
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"#,
                pts.join(" "),
                s.color
            );
            for p in &pts {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(out, r#"<circle cx="{x}" cy="{y}" r="2.5" fill="{}"/>"#, s.color);
            }
            let ly = top + 16.0 + k as f64 * 16.0;
            let _ = writeln!(
                out,
                r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
                LEFT + 10.0,
                ly - 4.0,
                LEFT + 30.0,
                ly - 4.0,
                s.color,
                LEFT + 36.0,
                ly,
                esc(s.name)
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

fn fmt_num(y: f64) -> String {
    if y >= 100.0 {
        format!("{y:.0}")
    } else if y >= 1.0 {
        format!("{y:.1}")
    } else {
        format!("{y:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_svg_has_every_series_and_axis() {
        let doc = svg(
            "put_bw <test>",
            "message size [bytes]",
            &[Panel {
                y_label: "MiB/s",
                series: vec![
                    Series {
                        name: "put",
                        color: "#1f77b4",
                        points: vec![(2.0, 1.0), (1024.0, 50.0), (8.0 * 1048576.0, 100.0)],
                    },
                    Series {
                        name: "copy",
                        color: "#ff7f0e",
                        points: vec![(2.0, 2.0), (8.0 * 1048576.0, 200.0)],
                    },
                ],
            }],
        );
        assert!(doc.starts_with("<svg") && doc.ends_with("</svg>\n"));
        assert_eq!(doc.matches("<polyline").count(), 2);
        assert!(doc.contains("put_bw &lt;test&gt;"));
        assert!(doc.contains(">8M<") && doc.contains(">2<"));
    }
}
