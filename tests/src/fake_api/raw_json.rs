//! JSON text as Go's `encoding/json` handles it, for the `RawExtension` fields whose bytes
//! kube-apiserver keeps verbatim (the opaque `parameters` of a ResourceClaim's config).
//!
//! - [`raw_at`] finds the exact text of one value in a request body, as the API server's
//!   decoder (`sigs.k8s.io/json`, a fork of `encoding/json`) hands it to
//!   `RawExtension.UnmarshalJSON` (kubernetes/kubernetes
//!   `staging/src/k8s.io/apimachinery/pkg/runtime/types.go`), which keeps it byte for byte.
//! - [`go_compact`] is what Go's encoder makes of such bytes when it writes the object again:
//!   `RawExtension.MarshalJSON` returns them unchanged and `encoding/json`'s
//!   `marshalerEncoder` runs them through `appendCompact` with HTML escaping on
//!   (`encoding/json/indent.go`): whitespace between tokens goes, key order and number
//!   spelling stay, `<`, `>`, `&`, U+2028 and U+2029 become `\u003c`-style escapes.
//! - [`go_encode`] is `json.Marshal` of a decoded value (`map[string]interface{}`), which
//!   strategic merge patches and server-side apply produce: compact, keys sorted, HTML
//!   escaped, integral numbers without a fraction.
//! - [`render_with_texts`] serializes an object with some of its values replaced by given
//!   texts, which [`serde_json::Value`] (without `raw_value`) cannot hold.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

/// The exact text of the value at `pointer` (RFC 6901) in the JSON document `doc`, or `None`
/// when the document has no value there or is not valid JSON up to it.
pub(super) fn raw_at<'a>(doc: &'a str, pointer: &str) -> Option<&'a str> {
    let mut scanner = Scanner {
        bytes: doc.as_bytes(),
        pos: 0,
    };
    scanner.skip_ws();
    if !pointer.is_empty() {
        for segment in pointer.strip_prefix('/')?.split('/') {
            let segment = segment.replace("~1", "/").replace("~0", "~");
            scanner.enter(&segment)?;
        }
    }
    let start = scanner.pos;
    let end = scanner.value_end(start)?;
    doc.get(start..end)
}

/// A cursor over JSON text that skips values without decoding them.
struct Scanner<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Scanner<'_> {
    fn skip_ws(&mut self) {
        while self
            .bytes
            .get(self.pos)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            self.pos += 1;
        }
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        self.skip_ws();
        (self.bytes.get(self.pos) == Some(&byte)).then(|| self.pos += 1)
    }

    /// Moves from the start of an object or array to the start of its member `segment`.
    fn enter(&mut self, segment: &str) -> Option<()> {
        self.skip_ws();
        match self.bytes.get(self.pos)? {
            b'{' => self.enter_object(segment),
            b'[' => self.enter_array(segment.parse().ok()?),
            _ => None,
        }
    }

    fn enter_object(&mut self, wanted: &str) -> Option<()> {
        self.pos += 1;
        loop {
            self.skip_ws();
            let key_start = self.pos;
            let key_end = self.string_end(key_start)?;
            let key: String = serde_json::from_slice(self.bytes.get(key_start..key_end)?).ok()?;
            self.pos = key_end;
            self.expect(b':')?;
            self.skip_ws();
            if key == wanted {
                return Some(());
            }
            self.pos = self.value_end(self.pos)?;
            self.expect(b',')?;
        }
    }

    fn enter_array(&mut self, index: usize) -> Option<()> {
        self.pos += 1;
        for _ in 0..index {
            self.skip_ws();
            self.pos = self.value_end(self.pos)?;
            self.expect(b',')?;
        }
        self.skip_ws();
        Some(())
    }

    /// The end (exclusive) of the string starting at `start`.
    fn string_end(&self, start: usize) -> Option<usize> {
        if self.bytes.get(start) != Some(&b'"') {
            return None;
        }
        let mut i = start + 1;
        loop {
            match self.bytes.get(i)? {
                b'\\' => i += 2,
                b'"' => return Some(i + 1),
                _ => i += 1,
            }
        }
    }

    /// The end (exclusive) of the value starting at `start`.
    fn value_end(&self, start: usize) -> Option<usize> {
        match self.bytes.get(start)? {
            b'"' => self.string_end(start),
            b'{' | b'[' => self.container_end(start),
            _ => {
                let len = self.bytes[start..]
                    .iter()
                    .position(|b| matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                    .unwrap_or(self.bytes.len() - start);
                (len > 0).then_some(start + len)
            }
        }
    }

    fn container_end(&self, start: usize) -> Option<usize> {
        let mut depth = 0_usize;
        let mut i = start;
        loop {
            match self.bytes.get(i)? {
                b'"' => {
                    i = self.string_end(i)?;
                    continue;
                }
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(i + 1);
                    }
                }
                _ => {}
            }
            i += 1;
        }
    }
}

/// Go's `appendCompact(dst, src, escape=true)`: `text` without whitespace between tokens,
/// with `<`, `>`, `&`, U+2028 and U+2029 escaped. `text` must be valid JSON.
pub(super) fn go_compact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_string = false;
    let mut escaped = false;
    for c in text.chars() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            push_html_escaped(&mut out, c);
            continue;
        }
        match c {
            ' ' | '\t' | '\n' | '\r' => {}
            '"' => {
                in_string = true;
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    out
}

fn push_html_escaped(out: &mut String, c: char) {
    match c {
        '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
            // Writing to a String cannot fail.
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        }
        _ => out.push(c),
    }
}

/// `json.Marshal` of `value` decoded into Go's `interface{}` with integers kept
/// (`sigs.k8s.io/json`'s `UnmarshalCaseSensitivePreserveInts`).
pub(super) fn go_encode(value: &Value) -> String {
    let mut out = String::new();
    encode_into(&mut out, value);
    out
}

fn encode_into(out: &mut String, value: &Value) {
    match value {
        Value::Null | Value::Bool(_) | Value::String(_) => {
            out.push_str(&go_compact(&value.to_string()));
        }
        Value::Number(number) => out.push_str(&go_number(number)),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                encode_into(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            // serde_json's map (without `preserve_order`) iterates in byte order of the
            // keys, as Go sorts map keys.
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&go_compact(&Value::String(key.clone()).to_string()));
                out.push(':');
                encode_into(out, item);
            }
            out.push('}');
        }
    }
}

/// A number as Go's `encoding/json` writes a float64 (`floatEncoder`): integral values below
/// 1e21 without a fraction, exponents as `e-07`/`e+21`; integers as they are.
fn go_number(number: &serde_json::Number) -> String {
    let Some(float) = number.as_f64().filter(|_| number.is_f64()) else {
        return number.to_string();
    };
    let abs = float.abs();
    if abs != 0.0 && !(1e-6..1e21).contains(&abs) {
        // Rust writes `1e-7`/`1.5e21`, Go `1e-07`/`1.5e+21`.
        let text = format!("{float:e}");
        let Some((mantissa, exponent)) = text.split_once('e') else {
            return text;
        };
        let (sign, digits) = match exponent.strip_prefix('-') {
            Some(digits) => ('-', digits),
            None => ('+', exponent),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    if float.fract() == 0.0 {
        return format!("{float:.0}");
    }
    float.to_string()
}

/// `object` serialized compactly, with the value at each pointer of `texts` written as the
/// given text instead of its [`Value`]. Pointers that `object` lacks are skipped.
pub(super) fn render_with_texts(object: &Value, texts: &BTreeMap<String, String>) -> Vec<u8> {
    if texts.is_empty() {
        return serde_json::to_vec(object).unwrap_or_default();
    }
    let mut marked = object.clone();
    let mut replacements = Vec::new();
    for (i, (pointer, text)) in texts.iter().enumerate() {
        if let Some(slot) = marked.pointer_mut(pointer) {
            // A control character cannot occur unescaped in serialized JSON, so the marker's
            // serialized form (with `\u0001`) cannot be confused with any string content.
            let marker = format!("\u{1}kerf-raw-{i}\u{1}");
            replacements.push((Value::String(marker.clone()).to_string(), text.as_str()));
            *slot = Value::String(marker);
        }
    }
    let mut rendered = marked.to_string();
    for (marker, text) in replacements {
        rendered = rendered.replacen(&marker, text, 1);
    }
    rendered.into_bytes()
}
