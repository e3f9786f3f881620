//! The stored-bytes chart: an inline SVG step line over the hourly history, with its
//! first and last hour and its largest value as labels. No script, no external file.

use maud::{html, Markup};

use super::format::{bytes, time};

const W: f64 = 720.0;
const H: f64 = 180.0;
const PAD_LEFT: f64 = 80.0;
const PAD_BOTTOM: f64 = 24.0;

/// The chart of `points`, (hour since the epoch, stored bytes), oldest first.
pub fn stored_bytes(points: &[(u64, u64)]) -> Markup {
    let Some((&(first, _), &(last, _))) = points.first().zip(points.last()) else {
        return html! { p #history { "No history yet: the registry samples its stored bytes every minute." } };
    };
    let max = points.iter().map(|p| p.1).max().unwrap_or(0).max(1);
    let span = (last - first).max(1) as f64;
    let x = |h: u64| PAD_LEFT + (h - first) as f64 / span * (W - PAD_LEFT - 10.0);
    let y = |b: u64| 10.0 + (1.0 - b as f64 / max as f64) * (H - PAD_BOTTOM - 10.0);
    // A step line: the value holds until the next sample.
    let mut d = String::new();
    for (i, &(h, b)) in points.iter().enumerate() {
        if i == 0 {
            d.push_str(&format!("M{:.1},{:.1}", x(h), y(b)));
        } else {
            d.push_str(&format!(" H{:.1} V{:.1}", x(h), y(b)));
        }
    }
    if points.len() == 1 {
        d.push_str(&format!(" H{:.1}", W - 10.0));
    }
    let base = H - PAD_BOTTOM;
    html! {
        svg #history width=(W) height=(H) viewBox={ "0 0 " (W) " " (H) } role="img"
            aria-label={ "Stored bytes from " (time(first * 3600)) " to " (time(last * 3600)) } {
            rect x="0" y="0" width=(W) height=(H) fill="#fff" {}
            line x1=(PAD_LEFT) y1=(base) x2=(W - 10.0) y2=(base) stroke="#999" {}
            line x1=(PAD_LEFT) y1="10" x2=(PAD_LEFT) y2=(base) stroke="#999" {}
            text x=(PAD_LEFT - 6.0) y="16" text-anchor="end" font-size="11" { (bytes(max)) }
            text x=(PAD_LEFT - 6.0) y=(base) text-anchor="end" font-size="11" { "0" }
            text x=(PAD_LEFT) y=(H - 6.0) font-size="11" { (time(first * 3600)) }
            text x=(W - 10.0) y=(H - 6.0) text-anchor="end" font-size="11" { (time(last * 3600)) }
            path d=(d) fill="none" stroke="#c0392b" stroke-width="2" {}
        }
    }
}
