//! The curves as an SVG picture, written by hand: one panel per trace, allocation ratio
//! against arrived demand, kerf's placers solid and the paper's policies dashed.

use std::fmt::Write as _;

use super::curve::Curve;

/// One curve of a panel.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub(crate) name: String,
    /// Measured by this bench (solid) or the paper's (dashed).
    pub(crate) ours: bool,
    pub(crate) points: Curve,
}

/// One trace's curves.
#[derive(Debug, Clone)]
pub(crate) struct Panel {
    pub(crate) title: String,
    pub(crate) series: Vec<Series>,
}

/// The window of each panel: arrived demand and allocation ratio, in percent.
const X_RANGE: (f64, f64) = (60.0, 130.0);
const Y_RANGE: (f64, f64) = (60.0, 100.0);
const PANEL_W: f64 = 300.0;
const PANEL_H: f64 = 200.0;
const MARGIN: f64 = 40.0;
const COLUMNS: usize = 2;
const LEGEND_H: f64 = 24.0;

/// One per series of a full run (7 of kerf's placers, the paper's 6), so that none repeats.
const COLORS: [&str; 13] = [
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf", "#ff7f0e", "#000000", "#393b79", "#843c39",
];

/// The SVG document of `panels`.
pub(crate) fn render(panels: &[Panel]) -> String {
    let names = legend_names(panels);
    let rows = panels.len().div_ceil(COLUMNS).max(1);
    let legend_rows = names.len().div_ceil(3);
    #[allow(clippy::cast_precision_loss)]
    let (width, top) = (
        COLUMNS as f64 * (PANEL_W + MARGIN) + MARGIN,
        legend_rows as f64 * LEGEND_H + MARGIN,
    );
    #[allow(clippy::cast_precision_loss)]
    let height = top + rows as f64 * (PANEL_H + MARGIN + 10.0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="{width}" height="{height}" fill="white"/>"#
    );
    for (i, (name, ours)) in names.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let (x, y) = (
            MARGIN + (i % 3) as f64 * 210.0,
            MARGIN / 2.0 + (i / 3) as f64 * LEGEND_H,
        );
        let _ = writeln!(
            out,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="2"{}/><text x="{}" y="{}">{}</text>"#,
            x + 24.0,
            color(i),
            dash(*ours),
            x + 30.0,
            y + 4.0,
            escape(name)
        );
    }
    for (p, panel) in panels.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let (left, upper) = (
            MARGIN + (p % COLUMNS) as f64 * (PANEL_W + MARGIN),
            top + (p / COLUMNS) as f64 * (PANEL_H + MARGIN + 10.0),
        );
        render_panel(&mut out, panel, &names, left, upper);
    }
    out.push_str("</svg>\n");
    out
}

fn legend_names(panels: &[Panel]) -> Vec<(String, bool)> {
    let mut names: Vec<(String, bool)> = Vec::new();
    for series in panels.iter().flat_map(|p| &p.series) {
        if !names.iter().any(|(n, _)| *n == series.name) {
            names.push((series.name.clone(), series.ours));
        }
    }
    names
}

fn color(i: usize) -> &'static str {
    COLORS[i % COLORS.len()]
}

fn dash(ours: bool) -> &'static str {
    if ours {
        ""
    } else {
        r#" stroke-dasharray="5,3""#
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn x_of(left: f64, x: f64) -> f64 {
    left + (x - X_RANGE.0) / (X_RANGE.1 - X_RANGE.0) * PANEL_W
}

fn y_of(top: f64, y: f64) -> f64 {
    top + PANEL_H - (y - Y_RANGE.0) / (Y_RANGE.1 - Y_RANGE.0) * PANEL_H
}

/// A panel's frame, title, grid and axis labels.
fn render_axes(out: &mut String, title: &str, left: f64, top: f64) {
    let _ = writeln!(
        out,
        r##"<rect x="{left}" y="{top}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#444"/><text x="{}" y="{}" font-weight="bold">{}</text>"##,
        left + 4.0,
        top - 4.0,
        escape(title)
    );
    for tick in (60..=130).step_by(10) {
        let x = x_of(left, f64::from(tick));
        let _ = writeln!(
            out,
            r##"<line x1="{x}" y1="{top}" x2="{x}" y2="{}" stroke="#ddd"/><text x="{x}" y="{}" text-anchor="middle">{tick}</text>"##,
            top + PANEL_H,
            top + PANEL_H + 12.0
        );
    }
    for tick in (60..=100).step_by(10) {
        let y = y_of(top, f64::from(tick));
        let _ = writeln!(
            out,
            r##"<line x1="{left}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{tick}</text>"##,
            left + PANEL_W,
            left - 3.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">arrived GPU demand (% of GPUs) → allocated (%)</text>"#,
        left + PANEL_W / 2.0,
        top + PANEL_H + 26.0
    );
}

fn render_panel(out: &mut String, panel: &Panel, names: &[(String, bool)], left: f64, top: f64) {
    render_axes(out, &panel.title, left, top);
    for series in &panel.series {
        let at = names
            .iter()
            .position(|(n, _)| *n == series.name)
            .unwrap_or(0);
        let points: Vec<String> = series
            .points
            .iter()
            .enumerate()
            .filter_map(|(x, y)| {
                #[allow(clippy::cast_precision_loss)]
                let x = x as f64;
                let y = (*y)?;
                (x >= X_RANGE.0 && y >= Y_RANGE.0)
                    .then(|| format!("{:.1},{:.1}", x_of(left, x), y_of(top, y)))
            })
            .collect();
        if points.len() > 1 {
            let _ = writeln!(
                out,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5"{} points="{}"/>"#,
                color(at),
                dash(series.ours),
                points.join(" ")
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_a_polyline_and_the_legend_names_it_once() {
        let curve: Curve = (0..=130).map(|x| Some(f64::from(x.min(95)))).collect();
        let panel = |title: &str| Panel {
            title: title.into(),
            series: vec![
                Series {
                    name: "kerf <default>".into(),
                    ours: true,
                    points: curve.clone(),
                },
                Series {
                    name: "paper FGD".into(),
                    ours: false,
                    points: curve.clone(),
                },
            ],
        };
        let svg = render(&[panel("default"), panel("cpu050")]);
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert_eq!(svg.matches("kerf &lt;default&gt;").count(), 1);
        assert_eq!(svg.matches("stroke-dasharray").count(), 3);
    }
}
