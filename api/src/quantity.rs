//! Byte counts written as Kubernetes quantities (`40Gi`, `512Mi`, `1.5G`, `8e9`).
//!
//! Neither k8s-openapi (whose `Quantity` is a plain string) nor kube parses quantities, so this
//! module does, with exact integer arithmetic: a quantity is accepted only when it denotes a
//! positive, whole number of bytes that Kubernetes itself can represent (at most 2^63-1).
//! The grammar is the one in `Quantity`'s documentation: an optionally signed decimal number
//! (`1`, `1.5`, `.5`, `1.`), then a binary suffix (`Ki` … `Ei`), a decimal suffix (`m`, `k`,
//! `M` … `E`) or a decimal exponent (`e3`, `E-2`), or nothing.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::error::{Error, Result};

/// The largest value Kubernetes can represent in a quantity.
pub(crate) const MAX_BYTES: u64 = u64::MAX >> 1;

/// u128 holds every number of up to 38 decimal digits.
const MAX_SIGNIFICANT_DIGITS: usize = 38;

const BINARY_SUFFIXES: [(&str, u32); 6] = [
    ("Ki", 10),
    ("Mi", 20),
    ("Gi", 30),
    ("Ti", 40),
    ("Pi", 50),
    ("Ei", 60),
];

// `n` and `u` are not in the documented grammar but the API server accepts them.
const DECIMAL_SUFFIXES: [(&str, i64); 10] = [
    ("", 0),
    ("n", -9),
    ("u", -6),
    ("m", -3),
    ("k", 3),
    ("M", 6),
    ("G", 9),
    ("T", 12),
    ("P", 15),
    ("E", 18),
];

/// Parses a quantity into a number of bytes.
///
/// # Errors
///
/// [`Error::InvalidQuantity`] when the text is not a quantity, or is zero, negative, not a
/// whole number of bytes (`0.5`, `1500m`, `0.1Ki`) or larger than `MAX_BYTES`.
pub fn parse_bytes(text: &str) -> Result<u64> {
    let invalid = |reason| Error::InvalidQuantity {
        value: text.to_owned(),
        reason,
    };
    let number = split_number(text).ok_or_else(|| {
        invalid("malformed: expected a number with an optional suffix, such as 512Mi, 40Gi, 1.5G or 8e9")
    })?;
    let scale = parse_suffix(number.suffix).ok_or_else(|| {
        invalid("unknown suffix: use Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E or an exponent such as e9")
    })?;
    let significant = significant_digits(number.integer, number.fraction);
    if significant.digits.is_empty() {
        return Err(invalid("must be greater than zero"));
    }
    if number.negative {
        return Err(invalid("must not be negative"));
    }
    if significant.digits.len() > MAX_SIGNIFICANT_DIGITS {
        return Err(invalid("has too many significant digits"));
    }
    let mantissa: u128 = significant
        .digits
        .parse()
        .map_err(|_| invalid("malformed digits"))?;
    let exp10 = scale.exp10 - significant.fraction_len;
    let bytes = scale_exactly(mantissa, exp10, scale.exp2).map_err(invalid)?;
    u64::try_from(bytes)
        .ok()
        .filter(|b| *b <= MAX_BYTES)
        .ok_or_else(|| {
            invalid("is larger than the largest quantity Kubernetes can represent (2^63-1)")
        })
}

/// Parses a [`Quantity`] into a number of bytes; see [`parse_bytes`].
///
/// # Errors
///
/// As [`parse_bytes`].
pub fn quantity_bytes(quantity: &Quantity) -> Result<u64> {
    parse_bytes(&quantity.0)
}

/// The quantity in units of 10^`exp10`, rounded up to a whole number: upstream
/// `resource.Quantity.ScaledValue` (k8s.io/apimachinery `pkg/api/resource/quantity.go`), so
/// `exp10` -3 is `MilliValue` (CPU in millicores: `100m` → 100, `0.5m` → 1) and 0 is `Value`
/// (bytes, units: `1.5` → 2). Zero is allowed, as requests and allocatable may be zero.
///
/// # Errors
///
/// [`Error::InvalidQuantity`] when the text is not a quantity, is negative, or its scaled
/// value does not fit in an `i64`.
pub fn scaled_ceil(quantity: &Quantity, exp10: i64) -> Result<i64> {
    const TOO_LARGE: &str = "is larger than the largest quantity Kubernetes can represent (2^63-1)";
    let text = quantity.0.as_str();
    let invalid = |reason| Error::InvalidQuantity {
        value: text.to_owned(),
        reason,
    };
    let number = split_number(text).ok_or_else(|| invalid("malformed"))?;
    let scale = parse_suffix(number.suffix).ok_or_else(|| invalid("unknown suffix"))?;
    let significant = significant_digits(number.integer, number.fraction);
    if significant.digits.is_empty() {
        return Ok(0);
    }
    if number.negative {
        return Err(invalid("must not be negative"));
    }
    if significant.digits.len() > MAX_SIGNIFICANT_DIGITS {
        return Err(invalid("has too many significant digits"));
    }
    let mantissa: u128 = significant
        .digits
        .parse()
        .map_err(|_| invalid("malformed digits"))?;
    let numerator = 1u128
        .checked_shl(scale.exp2)
        .filter(|_| scale.exp2 < 128)
        .and_then(|two_pow| mantissa.checked_mul(two_pow))
        .ok_or_else(|| invalid(TOO_LARGE))?;
    let exp = scale
        .exp10
        .saturating_sub(significant.fraction_len)
        .saturating_sub(exp10);
    let value = if exp >= 0 {
        u32::try_from(exp)
            .ok()
            .and_then(|e| 10u128.checked_pow(e))
            .and_then(|ten_pow| numerator.checked_mul(ten_pow))
            .ok_or_else(|| invalid(TOO_LARGE))?
    } else {
        match u32::try_from(exp.unsigned_abs())
            .ok()
            .and_then(|k| 10u128.checked_pow(k))
        {
            Some(ten_pow) => numerator.div_ceil(ten_pow),
            // The divisor exceeds every u128, the numerator is positive: rounds up to 1.
            None => 1,
        }
    };
    i64::try_from(value).map_err(|_| invalid(TOO_LARGE))
}

/// Formats a byte count as a quantity: with the largest binary suffix that keeps it whole
/// (`80Gi`, `81559Mi`), or as a plain integer when it is not a multiple of 1024.
pub fn format_bytes(bytes: u64) -> String {
    let suffix = BINARY_SUFFIXES
        .iter()
        .rev()
        .find(|(_, shift)| bytes != 0 && bytes.trailing_zeros() >= *shift);
    match suffix {
        Some((name, shift)) => format!("{}{name}", bytes >> shift),
        None => bytes.to_string(),
    }
}

/// [`format_bytes`] as a [`Quantity`].
pub fn bytes_quantity(bytes: u64) -> Quantity {
    Quantity(format_bytes(bytes))
}

struct Number<'a> {
    negative: bool,
    integer: &'a str,
    fraction: &'a str,
    suffix: &'a str,
}

/// Splits `[+-]digits[.digits]suffix`; `None` when there is no digit at all.
fn split_number(text: &str) -> Option<Number<'_>> {
    let (negative, rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let integer_len = leading_digits(rest);
    let (integer, rest) = rest.split_at(integer_len);
    let (fraction, suffix) = match rest.strip_prefix('.') {
        Some(after_dot) => after_dot.split_at(leading_digits(after_dot)),
        None => ("", rest),
    };
    if integer.is_empty() && fraction.is_empty() {
        return None;
    }
    Some(Number {
        negative,
        integer,
        fraction,
        suffix,
    })
}

fn leading_digits(text: &str) -> usize {
    text.bytes().take_while(u8::is_ascii_digit).count()
}

struct Scale {
    exp10: i64,
    exp2: u32,
}

fn parse_suffix(suffix: &str) -> Option<Scale> {
    if let Some((_, exp2)) = BINARY_SUFFIXES.iter().find(|(name, _)| *name == suffix) {
        return Some(Scale {
            exp10: 0,
            exp2: *exp2,
        });
    }
    if let Some((_, exp10)) = DECIMAL_SUFFIXES.iter().find(|(name, _)| *name == suffix) {
        return Some(Scale {
            exp10: *exp10,
            exp2: 0,
        });
    }
    // `E` alone is exa (handled above); `e`/`E` followed by a signed integer is an exponent.
    let exponent = suffix.strip_prefix(['e', 'E'])?;
    let digits = exponent.strip_prefix(['+', '-']).unwrap_or(exponent);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Beyond a few hundred the result is fractional or overflows either way, so huge
    // exponents are clamped rather than rejected as malformed.
    let exp10 = exponent
        .parse::<i64>()
        .unwrap_or(if exponent.starts_with('-') {
            i64::MIN
        } else {
            i64::MAX
        })
        .clamp(-1000, 1000);
    Some(Scale { exp10, exp2: 0 })
}

struct Significant {
    /// Integer and fraction digits without leading zeros or trailing fraction zeros.
    digits: String,
    /// How many of `digits` sit after the decimal point.
    fraction_len: i64,
}

fn significant_digits(integer: &str, fraction: &str) -> Significant {
    let fraction = fraction.trim_end_matches('0');
    let joined = format!("{integer}{fraction}");
    let digits = joined.trim_start_matches('0').to_owned();
    let fraction_len = i64::try_from(fraction.len()).unwrap_or(i64::MAX);
    Significant {
        digits,
        fraction_len,
    }
}

/// `mantissa * 10^exp10 * 2^exp2`, exactly, or why it is not a whole number that fits.
fn scale_exactly(mantissa: u128, exp10: i64, exp2: u32) -> Result<u128, &'static str> {
    const TOO_LARGE: &str = "is larger than the largest quantity Kubernetes can represent (2^63-1)";
    const FRACTIONAL: &str = "is not a whole number of bytes";
    let two_pow = |shift: u32| 1u128.checked_shl(shift).filter(|_| shift < 128);
    if exp10 >= 0 {
        let ten_pow = u32::try_from(exp10)
            .ok()
            .and_then(|e| 10u128.checked_pow(e))
            .ok_or(TOO_LARGE)?;
        return mantissa
            .checked_mul(ten_pow)
            .and_then(|v| v.checked_mul(two_pow(exp2)?))
            .ok_or(TOO_LARGE);
    }
    // mantissa * 2^exp2 / (2^k * 5^k): divide out 5^k first, then the remaining power of two.
    let k = u32::try_from(-exp10).map_err(|_| FRACTIONAL)?;
    let five_pow = 5u128.checked_pow(k).ok_or(FRACTIONAL)?;
    if !mantissa.is_multiple_of(five_pow) {
        return Err(FRACTIONAL);
    }
    let quotient = mantissa / five_pow;
    if exp2 >= k {
        return quotient
            .checked_mul(two_pow(exp2 - k).ok_or(TOO_LARGE)?)
            .ok_or(TOO_LARGE);
    }
    let divisor = two_pow(k - exp2).ok_or(FRACTIONAL)?;
    if !quotient.is_multiple_of(divisor) {
        return Err(FRACTIONAL);
    }
    Ok(quotient / divisor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(text: &str) -> u64 {
        parse_bytes(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn rejection(text: &str) -> &'static str {
        match parse_bytes(text) {
            Err(Error::InvalidQuantity { value, reason }) => {
                assert_eq!(value, text);
                reason
            }
            other => panic!("{text}: expected InvalidQuantity, got {other:?}"),
        }
    }

    fn ceil(text: &str, exp10: i64) -> i64 {
        scaled_ceil(&Quantity(text.to_owned()), exp10).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn milli_values_round_up_as_upstream() {
        assert_eq!(ceil("20", -3), 20_000);
        assert_eq!(ceil("100m", -3), 100);
        assert_eq!(ceil("0.5", -3), 500);
        assert_eq!(ceil("1.0001", -3), 1001);
        assert_eq!(ceil("500u", -3), 1);
        assert_eq!(ceil("1n", -3), 1);
        assert_eq!(ceil("0", -3), 0);
        assert_eq!(ceil("0m", -3), 0);
        assert_eq!(ceil("1Ki", -3), 1_024_000);
        assert_eq!(ceil("1e-40", -3), 1);
    }

    #[test]
    fn values_round_up_and_overflow_is_an_error() {
        assert_eq!(ceil("128Gi", 0), 128 << 30);
        assert_eq!(ceil("1.5", 0), 2);
        assert_eq!(ceil("2500m", 0), 3);
        assert_eq!(ceil("110", 0), 110);
        assert_eq!(ceil("9223372036854775807", 0), i64::MAX);
        for bad in ["8Ei", "-1", "x", "1Zi"] {
            assert!(scaled_ceil(&Quantity(bad.to_owned()), 0).is_err(), "{bad}");
        }
        assert!(scaled_ceil(&Quantity("9223372036854775807".to_owned()), -3).is_err());
    }

    #[test]
    fn binary_suffixes() {
        assert_eq!(bytes("1Ki"), 1024);
        assert_eq!(bytes("512Mi"), 512 << 20);
        assert_eq!(bytes("40Gi"), 40 << 30);
        assert_eq!(bytes("2Ti"), 2 << 40);
        assert_eq!(bytes("3Pi"), 3 << 50);
        assert_eq!(bytes("7Ei"), 7 << 60);
    }

    #[test]
    fn decimal_suffixes_and_plain_numbers() {
        assert_eq!(bytes("1"), 1);
        assert_eq!(bytes("+42"), 42);
        assert_eq!(bytes("1k"), 1_000);
        assert_eq!(bytes("5M"), 5_000_000);
        assert_eq!(bytes("40G"), 40_000_000_000);
        assert_eq!(bytes("1T"), 1_000_000_000_000);
        assert_eq!(bytes("2P"), 2_000_000_000_000_000);
        assert_eq!(bytes("1E"), 1_000_000_000_000_000_000);
        assert_eq!(bytes("2000m"), 2);
        assert_eq!(bytes("3000000u"), 3);
        assert_eq!(bytes("4000000000n"), 4);
    }

    #[test]
    fn fractions_that_are_whole_bytes() {
        assert_eq!(bytes("1.5Gi"), 1536 << 20);
        assert_eq!(bytes("0.5Ki"), 512);
        assert_eq!(bytes(".5Ki"), 512);
        assert_eq!(bytes("2.Gi"), 2 << 30);
        assert_eq!(bytes("1.25k"), 1250);
        assert_eq!(
            bytes("1.000000000000000000000000000000000000000000Gi"),
            1 << 30
        );
        assert_eq!(
            bytes("000000000000000000000000000000000000000000001Gi"),
            1 << 30
        );
        // 5^39 * 2^60 / 10^39 = 2^21: exact even though the product overflows u128.
        assert_eq!(
            bytes("0.000000000001818989403545856475830078125Ei"),
            1 << 21
        );
    }

    #[test]
    fn exponents() {
        assert_eq!(bytes("1e3"), 1_000);
        assert_eq!(bytes("8E9"), 8_000_000_000);
        assert_eq!(bytes("1.5e3"), 1_500);
        assert_eq!(bytes("1e+3"), 1_000);
        assert_eq!(bytes("12000e-3"), 12);
        assert_eq!(bytes("9223372036854775807"), MAX_BYTES);
    }

    #[test]
    fn rejects_zero_negative_fractional_and_overflow() {
        assert_eq!(rejection("0"), "must be greater than zero");
        assert_eq!(rejection("0Gi"), "must be greater than zero");
        assert_eq!(rejection("-0"), "must be greater than zero");
        assert_eq!(rejection("0.000e5"), "must be greater than zero");
        assert_eq!(rejection("-1Gi"), "must not be negative");
        assert_eq!(rejection("0.5"), "is not a whole number of bytes");
        assert_eq!(rejection("1500m"), "is not a whole number of bytes");
        assert_eq!(rejection("0.1Ki"), "is not a whole number of bytes");
        assert_eq!(rejection("1e-1"), "is not a whole number of bytes");
        assert_eq!(
            rejection("1e-99999999999"),
            "is not a whole number of bytes"
        );
        assert!(rejection("8Ei").contains("2^63-1"));
        assert!(rejection("9223372036854775808").contains("2^63-1"));
        assert!(rejection("1e19").contains("2^63-1"));
        assert!(rejection("1e99999999999").contains("2^63-1"));
        assert!(rejection("1e99999999999999999999999999").contains("2^63-1"));
        assert_eq!(
            rejection("1e-99999999999999999999999999"),
            "is not a whole number of bytes"
        );
        assert!(
            rejection("123456789012345678901234567890123456789").contains("significant digits")
        );
    }

    #[test]
    fn rejects_malformed_text() {
        for text in [
            "", "Gi", ".", "-", "+Gi", "1 Gi", " 1Gi", "1Gi ", "1..5Gi", "1.5.5", "0x10", "1,5Gi",
        ] {
            assert!(
                rejection(text).starts_with("malformed")
                    || rejection(text).starts_with("unknown suffix"),
                "{text}"
            );
        }
        for text in [
            "1K", "1KB", "1gi", "1Gb", "1e", "1E+", "1e1.5", "1ki", "1iB", "1mi", "1Ni", "1µ",
        ] {
            assert!(rejection(text).starts_with("unknown suffix"), "{text}");
        }
    }

    #[test]
    fn error_names_the_value() {
        let message = parse_bytes("-3Gi")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(message.contains("\"-3Gi\""), "{message}");
        assert!(message.contains("negative"), "{message}");
    }

    #[test]
    fn formats_with_the_largest_whole_binary_suffix() {
        assert_eq!(format_bytes(1), "1");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_bytes(1024), "1Ki");
        assert_eq!(format_bytes(80 << 30), "80Gi");
        assert_eq!(format_bytes(81_559 << 20), "81559Mi");
        assert_eq!(format_bytes(1536 << 20), "1536Mi");
        assert_eq!(format_bytes(0), "0");
        assert_eq!(bytes_quantity(1 << 60), Quantity("1Ei".into()));
    }

    const BINARY: [(&str, u32); 6] = BINARY_SUFFIXES;

    proptest! {
        #[test]
        fn format_then_parse_round_trips(value in 1u64..=MAX_BYTES) {
            prop_assert_eq!(parse_bytes(&format_bytes(value)).ok(), Some(value));
        }

        #[test]
        fn binary_suffix_multiplies(n in 1u64..1_000_000, which in 0usize..6) {
            let (suffix, shift) = BINARY[which];
            let expected = u128::from(n) << shift;
            let parsed = parse_bytes(&format!("{n}{suffix}"));
            if expected <= u128::from(MAX_BYTES) {
                prop_assert_eq!(parsed.ok().map(u128::from), Some(expected));
            } else {
                prop_assert!(parsed.is_err());
            }
        }

        #[test]
        fn decimal_exponent_multiplies(n in 1u64..1_000_000, exp in 0u32..20) {
            let expected = u128::from(n) * 10u128.pow(exp);
            let parsed = parse_bytes(&format!("{n}e{exp}"));
            if expected <= u128::from(MAX_BYTES) {
                prop_assert_eq!(parsed.ok().map(u128::from), Some(expected));
            } else {
                prop_assert!(parsed.is_err());
            }
        }

        #[test]
        fn fractional_binary_is_exact(int in 0u64..100_000, frac in "[0-9]{1,6}", which in 0usize..6) {
            let (suffix, shift) = BINARY[which];
            let scale = 10u128.pow(u32::try_from(frac.len()).unwrap_or(0));
            let numerator = (u128::from(int) * scale + frac.parse::<u128>().unwrap_or(0)) << shift;
            let parsed = parse_bytes(&format!("{int}.{frac}{suffix}"));
            if numerator == 0 {
                prop_assert!(parsed.is_err());
            } else if numerator % scale == 0 && numerator / scale <= u128::from(MAX_BYTES) {
                prop_assert_eq!(parsed.ok().map(u128::from), Some(numerator / scale));
            } else {
                prop_assert!(parsed.is_err());
            }
        }

        #[test]
        fn negative_values_are_rejected(n in 1u64..u64::MAX, suffix in "(|Ki|Mi|Gi|k|M|G|e3)") {
            let text = format!("-{n}{suffix}");
            prop_assert!(parse_bytes(&text).is_err());
        }

        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,40}") {
            let _ = parse_bytes(&text);
        }

        #[test]
        fn accepted_values_are_positive_and_representable(text in "[+-]?[0-9]{0,4}(\\.[0-9]{0,4})?(|Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|e[+-]?[0-9]{1,2})") {
            let parsed = parse_bytes(&text);
            // Checked against the oracle first: a parser that rejected everything would
            // otherwise pass the range checks below vacuously.
            prop_assert_eq!(parsed.as_ref().ok().copied(), expected_bytes(&text), "{}", text);
            if let Ok(value) = parsed {
                prop_assert!((1..=MAX_BYTES).contains(&value));
                prop_assert!(!text.starts_with('-'));
            }
        }
    }

    /// An independent reading of the grammar `accepted_values_are_positive_and_representable`
    /// generates, as an exact fraction: the bytes a valid quantity denotes, or `None`.
    fn expected_bytes(text: &str) -> Option<u64> {
        let (negative, rest) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text.strip_prefix('+').unwrap_or(text)),
        };
        let end = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(end);
        let (integer, fraction) = number.split_once('.').unwrap_or((number, ""));
        if integer.is_empty() && fraction.is_empty() {
            return None;
        }
        let pow10 = |n: u32| 10u128.checked_pow(n);
        let frac_len = u32::try_from(fraction.len()).ok()?;
        let mut numerator = format!("0{integer}{fraction}").parse::<u128>().ok()?;
        let mut denominator = pow10(frac_len)?;
        if numerator == 0 || negative {
            return None;
        }
        let (exp10, exp2): (i32, u32) = match suffix {
            "" => (0, 0),
            "m" => (-3, 0),
            "k" => (3, 0),
            "M" => (6, 0),
            "G" => (9, 0),
            "T" => (12, 0),
            "P" => (15, 0),
            "E" => (18, 0),
            "Ki" => (0, 10),
            "Mi" => (0, 20),
            "Gi" => (0, 30),
            "Ti" => (0, 40),
            "Pi" => (0, 50),
            "Ei" => (0, 60),
            exponent => (exponent.strip_prefix('e')?.parse().ok()?, 0),
        };
        numerator = numerator.checked_shl(exp2)?;
        // Overflowing u128 with at most 4 fraction digits means far beyond MAX_BYTES; a
        // divisor beyond u128 leaves a fraction of a byte: both are rejections.
        if exp10 >= 0 {
            numerator = numerator.checked_mul(pow10(exp10.unsigned_abs())?)?;
        } else {
            denominator = denominator.checked_mul(pow10(exp10.unsigned_abs())?)?;
        }
        if numerator % denominator != 0 {
            return None;
        }
        u64::try_from(numerator / denominator)
            .ok()
            .filter(|b| *b <= MAX_BYTES)
    }
}
