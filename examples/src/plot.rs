//! `--plot FILE.svg`: charts of a sweep against message size, one panel per quantity, each with
//! the measured series and its reference. Sizes and rates are on log axes with round ticks
//! (1, 2, 5 times a power of ten), so a series 100x below its reference stays readable; a
//! ratio panel shows the two against each other. A run of one size gets a table instead.
//! Plain SVG text: no plotting crate, because their text rendering needs font libraries on the
//! machine, and the charts are a few lines and polylines.
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{Seek as _, Write as _};
use std::path::{Path, PathBuf};

/// One line of a panel.
pub struct Series<'a> {
    /// Legend text.
    pub name: &'a str,
    /// CSS colour.
    pub color: &'a str,
    /// Drawn dashed (a secondary figure, like a peak next to its average).
    pub dashed: bool,
    /// (x, y) points, x > 0.
    pub points: Vec<(f64, f64)>,
}

/// How a panel's y axis maps values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// Linear from 0.
    Linear,
    /// Logarithmic over the values' decades (values <= 0 are left out).
    Log,
}

/// One chart.
pub struct Panel<'a> {
    /// Y-axis label.
    pub y_label: &'a str,
    /// Its y axis.
    pub scale: Scale,
    /// Its lines.
    pub series: Vec<Series<'a>>,
}

/// The file `--plot` names, opened before the run so that a path that cannot be written fails
/// at once rather than after the measurements. A file it created is removed again unless
/// [`PlotFile::write`] is reached; one that existed is left as it was until then.
pub struct PlotFile {
    path: PathBuf,
    file: Option<File>,
    created: bool,
}

impl PlotFile {
    /// Checks the name (`*.svg`) and opens the file for writing.
    pub fn open(path: &Path) -> anyhow::Result<PlotFile> {
        if path.extension().is_none_or(|e| !e.eq_ignore_ascii_case("svg")) {
            anyhow::bail!("--plot {}: the plot is an SVG file (name it *.svg)", path.display());
        }
        let existed = path.exists();
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| anyhow::anyhow!("--plot {}: cannot be written: {e}", path.display()))?;
        Ok(PlotFile {
            path: path.to_path_buf(),
            file: Some(file),
            created: !existed,
        })
    }

    /// Replaces the file's content with `doc`.
    pub fn write(mut self, doc: &str) -> anyhow::Result<()> {
        let mut f = self.file.take().expect("a PlotFile is written once");
        let written = f
            .set_len(0)
            .and_then(|()| f.rewind())
            .and_then(|()| f.write_all(doc.as_bytes()));
        self.created = false;
        written.map_err(|e| anyhow::anyhow!("writing {}: {e}", self.path.display()))
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PlotFile {
    fn drop(&mut self) {
        if self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

const W: f64 = 760.0;
const PANEL_H: f64 = 260.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 50.0;
/// One legend row, above its panel (never inside it, where lines would run through it).
const LEGEND_ROW: f64 = 16.0;

/// About how wide `text` is at the documents' 12 px sans-serif (bold a little wider): an
/// average advance of 0.62 em, wide enough for digits and capitals, so that laid-out text does
/// not overlap in any common font.
fn text_width(text: &str, bold: bool) -> f64 {
    text.chars().count() as f64 * if bold { 8.0 } else { 7.4 }
}

/// Where a panel's legend entries go: (x, row) for each, rows filling the panel's width.
fn legend_layout(series: &[Series<'_>]) -> Vec<(f64, usize)> {
    let (mut x, mut row, mut out) = (LEFT, 0, Vec::new());
    for s in series {
        let w = 36.0 + text_width(s.name, false) + 18.0;
        if x > LEFT && x + w > W - RIGHT {
            x = LEFT;
            row += 1;
        }
        out.push((x, row));
        x += w;
    }
    out
}

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

/// A y axis: the range it shows and its ticks.
struct Axis {
    scale: Scale,
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
}

impl Axis {
    fn new(scale: Scale, values: impl Iterator<Item = f64>) -> Axis {
        match scale {
            Scale::Linear => {
                let max = values.filter(|v| v.is_finite()).fold(0.0f64, f64::max);
                let step = nice_step(max.max(1e-12) / 5.0);
                let hi = (max / step).ceil().max(1.0) * step;
                let n = (hi / step).round() as usize;
                Axis {
                    scale,
                    lo: 0.0,
                    hi,
                    ticks: (0..=n).map(|k| k as f64 * step).collect(),
                }
            }
            Scale::Log => {
                let (min, max) = values
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
                let (min, max) = if min > max { (1.0, 10.0) } else { (min, max) };
                let (d0, d1) = (min.log10().floor(), max.log10().ceil().max(min.log10().floor() + 1.0));
                // 1-2-5 ticks over up to 3 decades, one per decade beyond.
                let mults: &[f64] = if d1 - d0 <= 3.0 { &[1.0, 2.0, 5.0] } else { &[1.0] };
                let mut ticks = Vec::new();
                for d in d0 as i32..=d1 as i32 {
                    for m in mults {
                        let t = m * 10f64.powi(d);
                        if t <= 10f64.powf(d1) * 1.0001 {
                            ticks.push(t);
                        }
                    }
                }
                Axis {
                    scale,
                    lo: 10f64.powf(d0),
                    hi: 10f64.powf(d1),
                    ticks,
                }
            }
        }
    }

    /// Where `v` is, 0 (bottom) to 1 (top); `None` for values a log axis cannot show.
    fn at(&self, v: f64) -> Option<f64> {
        match self.scale {
            Scale::Linear => Some((v - self.lo) / (self.hi - self.lo)),
            Scale::Log if v > 0.0 => Some((v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())),
            Scale::Log => None,
        }
    }
}

/// The round step (1, 2 or 5 times a power of ten) at or above `raw`.
fn nice_step(raw: f64) -> f64 {
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|s| *s >= raw * 0.9999)
        .unwrap_or(10.0 * p)
}

/// The SVG document: `title` on top, then the panels stacked, sharing the x range (log 2).
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
    let legends: Vec<Vec<(f64, usize)>> = panels.iter().map(|p| legend_layout(&p.series)).collect();
    let legend_h = |l: &[(f64, usize)]| l.last().map_or(0.0, |&(_, row)| (row + 1) as f64 * LEGEND_ROW + 6.0);
    let height = TOP + legends.iter().map(|l| legend_h(l) + PANEL_H + BOTTOM).sum::<f64>() + 10.0;
    let mut out = header(title, W, height);
    let plot_w = W - LEFT - RIGHT;
    let mut block = TOP;
    for (panel, legend) in panels.iter().zip(&legends) {
        let top = block + legend_h(legend);
        block = top + PANEL_H + BOTTOM;
        let axis = Axis::new(
            panel.scale,
            panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.1)),
        );
        let px = |x: f64| LEFT + (x.log2() - lx0) / (lx1 - lx0) * plot_w;
        let py = |y: f64| axis.at(y).map(|f| top + PANEL_H - f * PANEL_H);
        let _ = writeln!(
            out,
            r##"<rect x="{LEFT}" y="{top}" width="{plot_w}" height="{PANEL_H}" fill="none" stroke="#444"/>"##
        );
        for &t in &axis.ticks {
            let Some(yy) = py(t) else { continue };
            let _ = writeln!(
                out,
                r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + plot_w,
                LEFT - 6.0,
                yy + 4.0,
                fmt_num(t)
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
        let y_label = match panel.scale {
            Scale::Log => format!("{} (log)", panel.y_label),
            Scale::Linear => panel.y_label.to_string(),
        };
        let _ = writeln!(
            out,
            r#"<text transform="translate(16,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            top + PANEL_H / 2.0,
            esc(&y_label)
        );
        for (s, &(lx, row)) in panel.series.iter().zip(legend) {
            let pts: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter(|p| p.0 > 0.0 && p.1.is_finite())
                .filter_map(|&(x, y)| Some((px(x), py(y)?)))
                .collect();
            let dash = if s.dashed { r#" stroke-dasharray="6,4""# } else { "" };
            let line: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{dash}/>"#,
                line.join(" "),
                s.color
            );
            for (x, y) in &pts {
                let _ = writeln!(out, r#"<circle cx="{x:.1}" cy="{y:.1}" r="2.5" fill="{}"/>"#, s.color);
            }
            // Rows from the top of the panel's block down to just above its frame.
            let ly = top - legend_h(legend) + 2.0 + (row + 1) as f64 * LEGEND_ROW - 4.0;
            let _ = writeln!(
                out,
                r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{}" stroke-width="2"{dash}/><text class="legend" x="{:.1}" y="{:.1}">{}</text>"#,
                lx + 4.0,
                ly - 4.0,
                lx + 28.0,
                ly - 4.0,
                s.color,
                lx + 34.0,
                ly,
                esc(s.name)
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

/// The SVG of a run with nothing to plot against (one size): its figures as a table, each
/// column as wide as its widest cell (the document widens rather than letting them overlap).
pub fn table(title: &str, head: &[&str], rows: &[Vec<String>]) -> String {
    const ROW_H: f64 = 22.0;
    const GAP: f64 = 18.0;
    const MARGIN: f64 = 20.0;
    let head: Vec<String> = head.iter().map(|h| h.to_string()).collect();
    let all: Vec<&Vec<String>> = std::iter::once(&head).chain(rows).collect();
    let columns = all.iter().map(|r| r.len()).max().unwrap_or(0);
    let widths: Vec<f64> = (0..columns)
        .map(|c| {
            all.iter()
                .enumerate()
                .filter_map(|(r, cells)| cells.get(c).map(|t| text_width(t, r == 0)))
                .fold(0.0, f64::max)
        })
        .collect();
    let content = widths.iter().map(|w| w + GAP).sum::<f64>();
    let width = W
        .max(content + 2.0 * MARGIN)
        .max(text_width(title, false) * 1.25 + 2.0 * MARGIN);
    // Centred when the columns need less than the document's width.
    let left = (width - content) / 2.0;
    let height = TOP + ROW_H * (rows.len() as f64 + 1.0) + 20.0;
    let mut out = header(title, width, height);
    for (r, cells) in all.iter().enumerate() {
        let y = TOP + r as f64 * ROW_H;
        let weight = if r == 0 { r#" font-weight="bold""# } else { "" };
        let mut right = left;
        for (cell, w) in cells.iter().zip(&widths) {
            right += w + GAP;
            let _ = writeln!(
                out,
                r#"<text x="{:.1}" y="{y:.1}" text-anchor="end"{weight}>{}</text>"#,
                right - GAP / 2.0,
                esc(cell)
            );
        }
    }
    out.push_str("</svg>\n");
    out
}

fn header(title: &str, width: f64, height: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        width / 2.0,
        esc(title)
    );
    out
}

/// A tick label: round values print without noise ("0.05", "2000", "1e+06" for large ones).
fn fmt_num(y: f64) -> String {
    if y == 0.0 {
        "0".into()
    } else if y >= 1e6 {
        format!("{y:.0e}")
    } else if y >= 1.0 {
        format!("{}", (y * 1000.0).round() / 1000.0)
    } else {
        let digits = (-y.log10()).ceil() as usize + 1;
        let s = format!("{y:.digits$}");
        s.trim_end_matches('0').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &'static str, points: Vec<(f64, f64)>) -> Series<'static> {
        Series {
            name,
            color: "#1f77b4",
            dashed: false,
            points,
        }
    }

    #[test]
    fn the_svg_has_every_series_and_axis() {
        let doc = svg(
            "put_bw <test>",
            "message size [bytes]",
            &[Panel {
                y_label: "MiB/s",
                scale: Scale::Log,
                series: vec![
                    series("put", vec![(2.0, 1.0), (1024.0, 50.0), (8.0 * 1048576.0, 100.0)]),
                    Series {
                        dashed: true,
                        ..series("copy", vec![(2.0, 2.0), (8.0 * 1048576.0, 200.0)])
                    },
                ],
            }],
        );
        assert!(doc.starts_with("<svg") && doc.ends_with("</svg>\n"));
        assert_eq!(doc.matches("<polyline").count(), 2);
        assert!(doc.contains("stroke-dasharray"));
        assert!(doc.contains("put_bw &lt;test&gt;"));
        assert!(doc.contains(">8M<") && doc.contains(">2<"));
        assert!(doc.contains("MiB/s (log)"));
    }

    /// Ticks are round (1, 2 or 5 times a power of ten, or multiples of such a step on a linear
    /// axis), inside the axis, and cover the values; on a
    /// log axis a series 100x below another still spans a readable part of the panel (on a
    /// linear one it was a flat line at the bottom).
    #[test]
    fn ticks_are_round_and_small_series_stay_readable() {
        let round = |t: f64| {
            let m = t / 10f64.powf(t.log10().floor());
            [1.0, 2.0, 5.0].iter().any(|r| (m - r).abs() < 1e-9)
        };
        for (scale, values) in [
            (Scale::Log, vec![3.7, 412.0]),
            (Scale::Log, vec![0.013, 98000.0]),
            (Scale::Linear, vec![0.0, 37.2]),
            (Scale::Linear, vec![1234.0, 98765.0]),
        ] {
            let a = Axis::new(scale, values.iter().copied());
            assert!(a.ticks.len() >= 3, "{scale:?} {values:?}: {:?}", a.ticks);
            // Log ticks are round themselves, linear ones multiples of a round step.
            let step = a.ticks[1] - a.ticks[0];
            for &t in &a.ticks {
                match scale {
                    Scale::Log => assert!(round(t), "tick {t}"),
                    Scale::Linear => assert!(round(step) && ((t / step).round() * step - t).abs() < 1e-6 * step),
                }
                assert!((0.0..=1.0 + 1e-9).contains(&a.at(t).unwrap()), "{t}");
            }
            for v in values {
                assert!((0.0..=1.0).contains(&a.at(v).unwrap()), "{scale:?}: {v} off the axis");
            }
        }
        let log = Axis::new(Scale::Log, [10.0, 1000.0, 100_000.0].into_iter());
        let linear = Axis::new(Scale::Linear, [10.0, 1000.0, 100_000.0].into_iter());
        let span = |a: &Axis| a.at(1000.0).unwrap() - a.at(10.0).unwrap();
        assert!(span(&log) > 0.3 && span(&linear) < 0.02);
        assert_eq!(fmt_num(0.05), "0.05");
        assert_eq!(fmt_num(2000.0), "2000");
    }

    /// (x, y, bold, content) of every `<text>` of `doc` with a position.
    fn texts(doc: &str) -> Vec<(f64, f64, bool, String)> {
        let attr = |tag: &str, name: &str| {
            let at = tag.find(&format!(" {name}=\""))? + name.len() + 3;
            tag[at..].split('"').next()?.parse::<f64>().ok()
        };
        doc.split("<text")
            .skip(1)
            .filter_map(|t| {
                let (tag, rest) = t.split_once('>')?;
                let content = rest.split("</text>").next()?.to_string();
                Some((attr(tag, "x")?, attr(tag, "y")?, tag.contains("bold"), content))
            })
            .collect()
    }

    /// The one-size table with put_bw's columns: in every row each cell (right-aligned at its
    /// x) ends before the next begins, and all lie inside the document.
    #[test]
    fn table_cells_do_not_overlap() {
        let head = [
            "#bytes",
            "BW peak [MiB/s]",
            "BW average [MiB/s]",
            "msg rate [Mpps]",
            "ref [MiB/s]",
            "BW / ref",
        ];
        let row: Vec<String> = ["1048576", "280123.45", "279876.54", "0.266903", "1234567.89", "22.7%"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let doc = table(
            "put_bw, 1 qp(s), warp scope, one process (device copy as reference)",
            &head,
            &[row],
        );
        let width = doc
            .split("width=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap();
        let cells: Vec<_> = texts(&doc).into_iter().filter(|t| t.1 >= TOP).collect();
        assert_eq!(cells.len(), 12);
        for y in [TOP, TOP + 22.0] {
            let mut row: Vec<_> = cells.iter().filter(|c| c.1 == y).collect();
            row.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut end = 0.0;
            for (x, _, bold, text) in row {
                let start = x - text_width(text, *bold);
                assert!(
                    start >= end + 4.0,
                    "{text:?} starts at {start:.1}, the cell before ends at {end:.1}"
                );
                assert!(*x <= width, "{text:?} ends past the document ({width})");
                end = *x;
            }
        }
    }

    /// Every legend entry sits outside every panel's frame, where no line is drawn.
    #[test]
    fn legends_sit_outside_the_panels() {
        let lines = |names: [&'static str; 3]| {
            names
                .into_iter()
                .map(|n| series(n, vec![(2.0, 5.0), (4096.0, 50.0), (1048576.0, 500.0)]))
                .collect()
        };
        let doc = svg(
            "put_bw, two panels",
            "message size [bytes]",
            &[
                Panel {
                    y_label: "bandwidth [MiB/s]",
                    scale: Scale::Log,
                    series: lines(["put_bw average", "put_bw peak", "device copy"]),
                },
                Panel {
                    y_label: "message rate [Mpps]",
                    scale: Scale::Log,
                    series: lines(["put_bw", "device copy at the same size", "x"]),
                },
            ],
        );
        let frames: Vec<f64> = doc
            .lines()
            .filter(|l| l.starts_with(&format!("<rect x=\"{LEFT}\"")))
            .map(|l| {
                l.split("y=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        assert_eq!(frames.len(), 2);
        let names = [
            "put_bw average",
            "put_bw peak",
            "device copy",
            "put_bw",
            "device copy at the same size",
            "x",
        ];
        let legend: Vec<_> = texts(&doc)
            .into_iter()
            .filter(|t| names.contains(&t.3.as_str()))
            .collect();
        assert_eq!(legend.len(), names.len());
        for (_, y, _, name) in legend {
            for top in &frames {
                // The text's box: 12 px above its baseline to 3 below.
                assert!(
                    y + 3.0 < *top || y - 12.0 > top + PANEL_H,
                    "legend {name:?} at y {y} is inside the panel at {top}"
                );
            }
        }
    }

    #[test]
    fn one_size_gives_a_table() {
        let doc = table("t", &["#bytes", "BW"], &[vec!["64".into(), "12.5".into()]]);
        assert!(doc.contains(">#bytes<") && doc.contains(">12.5<"));
        assert!(!doc.contains("<polyline"));
    }

    /// A path that cannot be written fails before the run, and leaves nothing behind; a file
    /// that opened but was never written is removed.
    #[test]
    fn the_plot_file_is_checked_first_and_cleaned_up() {
        let dir = std::env::temp_dir().join(format!("gdaki-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = PlotFile::open(&dir.join("no/such/dir/x.svg")).err().unwrap();
        assert!(err.to_string().contains("cannot be written"), "{err}");
        assert!(PlotFile::open(&dir.join("x.png")).is_err());
        let p = dir.join("x.svg");
        drop(PlotFile::open(&p).unwrap());
        assert!(!p.exists());
        PlotFile::open(&p).unwrap().write("<svg/>").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "<svg/>");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
