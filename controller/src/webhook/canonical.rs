//! The JSON encoding kube-apiserver gives a `RawExtension` whenever it re-encodes one, so that
//! bytes written in this form survive every later write of the object unchanged.
//!
//! Why it matters: a `RawExtension` keeps the bytes a client sent
//! (`UnmarshalJSON` in `staging/src/k8s.io/apimachinery/pkg/runtime/extension.go` copies them),
//! and `ResourceClaim.spec` is immutable, compared byte for byte. Every patch re-encodes the
//! stored object first:
//! - `MarshalJSON` returns the raw bytes and Go's `encoding/json` compacts a marshaler's output
//!   with HTML escaping (`appendCompact(…, escapeHTML)` in `encoding/json/indent.go`), which is
//!   what a JSON merge patch keeps for untouched fields (`gopkg.in/evanphx/json-patch.v4`,
//!   `lazyNode` holds the raw message);
//! - strategic merge patch and server-side apply go through
//!   `runtime.DefaultUnstructuredConverter` (`ToUnstructured` decodes the raw bytes with
//!   `k8s.io/apimachinery/pkg/util/json`: integers that fit become `int64`, other numbers
//!   `float64`; `FromUnstructured` encodes the map again with `encoding/json`, which sorts map
//!   keys).
//!
//! So the form that every path reproduces is: compact, object keys sorted by bytes, strings
//! escaped as `encoding/json` escapes them (`"`, `\`, `\b`, `\f`, `\n`, `\r`, `\t`, other
//! control characters as `\u00xx`, `<` `>` `&` as `\u003c` `\u003e` `\u0026`, U+2028 and
//! U+2029 as `\u2028` `\u2029`; Go 1.22+ writes `\b`/`\f`, Kubernetes 1.34 is built with
//! Go 1.24), integers in `int64` range as digits, other numbers as `encoding/json` writes a
//! `float64` (`floatEncoder` in `encoding/json/encode.go`: shortest digits, exponent form
//! below 1e-6 and from 1e21).
//!
//! One limit: serde_json (without its `float_roundtrip` feature, which this build does not
//! enable) may read a number whose digits exceed 2^53 or whose exponent is beyond ±22 one unit
//! in the last place off Go's correctly rounded `ParseFloat`, and then writes other digits than
//! Go would. `GpuClaimParameters` need no such number: `compute` is an integer 1–100, a
//! `memory` written as an integer takes the exact `int64` path, and a fractional-looking one
//! that large would be petabytes, which no GPU has.

use std::fmt::Write as _;

use serde_json::{Number, Value};

/// `value` in the canonical form described in the module documentation.
pub fn canonical(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

fn write_value(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => write_number(out, n),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(fields) => {
            // Sorted here rather than trusting the map's order: serde_json keeps insertion
            // order when any crate in the build enables its `preserve_order` feature.
            let mut entries: Vec<_> = fields.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(out, key);
                out.push(':');
                write_value(out, item);
            }
            out.push('}');
        }
    }
}

fn write_number(out: &mut String, number: &Number) {
    if let Some(i) = number.as_i64() {
        let _ = write!(out, "{i}");
    } else if let Some(f) = number.as_f64() {
        // Beyond int64 (a u64 too large, or a fraction) util/json decodes a float64.
        out.push_str(&go_float(f));
    } else {
        let _ = write!(out, "{number}");
    }
}

/// A `float64` as `encoding/json` writes it (`floatEncoder.encode`): `strconv.FormatFloat`
/// with the shortest digits, format `'f'`, or `'e'` when the magnitude is below 1e-6 or at
/// least 1e21, with the exponent's leading zero dropped (`e-07` → `e-7`).
fn go_float(f: f64) -> String {
    let magnitude = f.abs();
    if magnitude != 0.0 && !(1e-6..1e21).contains(&magnitude) {
        // Rust's `{:e}` gives the same shortest digits as `'e', -1`, without a `+` on
        // positive exponents and without leading zeros.
        let text = format!("{f:e}");
        match text.split_once('e') {
            Some((mantissa, exponent)) if !exponent.starts_with('-') => {
                format!("{mantissa}e+{exponent}")
            }
            _ => text,
        }
    } else {
        // Display: shortest round-trip digits, never an exponent, no `.0` on whole numbers.
        format!("{f}")
    }
}

fn write_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' | '\u{0}'..='\u{1f}' => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn objects_are_compact_and_sorted_at_every_level() {
        let spaced: Value = serde_json::from_str(
            r#"{"memory": "10Gi", "kind": "GpuClaimParameters", "apiVersion": "gpu.kerf.dev/v1alpha1",
                "topology": {"scope": "NVLink", "a": [1, {"z": null, "b": true}]}}"#,
        )
        .unwrap();
        assert_eq!(
            canonical(&spaced),
            r#"{"apiVersion":"gpu.kerf.dev/v1alpha1","kind":"GpuClaimParameters","memory":"10Gi","topology":{"a":[1,{"b":true,"z":null}],"scope":"NVLink"}}"#
        );
        // Keys sort by bytes, as Go's strings.Compare: upper case before lower case.
        assert_eq!(
            canonical(&json!({"b": 1, "B": 2, "é": 3, "a": 4})),
            r#"{"B":2,"a":4,"b":1,"é":3}"#
        );
    }

    #[test]
    fn strings_are_escaped_as_go_escapes_them() {
        let text = "<a> & \"q\" \\ \n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f} \u{2028}\u{2029} é 😀";
        assert_eq!(
            canonical(&json!(text)),
            r#""\u003ca\u003e \u0026 \"q\" \\ \n\r\t\b\f\u0001\u001f"#.to_owned()
                + "\u{7f} \\u2028\\u2029 é 😀\""
        );
    }

    #[test]
    fn numbers_are_written_as_go_writes_int64_and_float64() {
        let cases = [
            ("100", "100"),
            ("-5", "-5"),
            ("0", "0"),
            ("1073741824", "1073741824"),
            ("9223372036854775807", "9223372036854775807"),
            ("18446744073709551615", "18446744073709552000"),
            ("1e3", "1000"),
            ("50.0", "50"),
            ("0.5", "0.5"),
            ("1.5e-7", "1.5e-7"),
            ("0.000001", "0.000001"),
            ("1e21", "1e+21"),
            ("2.5e21", "2.5e+21"),
            ("-1.25e-8", "-1.25e-8"),
            ("1e20", "100000000000000000000"),
        ];
        for (input, expected) in cases {
            let value: Value = serde_json::from_str(input).unwrap();
            assert_eq!(canonical(&value), expected, "{input}");
        }
    }

    #[test]
    fn the_form_is_a_fixed_point() {
        for text in [
            r#"{"z": [1.5, 2e30, "x<y"], "a": {"k": "\u2028"}}"#,
            r#"{"apiVersion":"gpu.kerf.dev/v1alpha1","kind":"GpuClaimParameters","compute":50}"#,
        ] {
            let once = canonical(&serde_json::from_str(text).unwrap());
            let twice = canonical(&serde_json::from_str(&once).unwrap());
            assert_eq!(once, twice);
        }
    }
}
