//! Percentiles and the formatting of figures.

use std::time::Duration;

/// A set of measured durations, sorted once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Samples {
    sorted: Vec<Duration>,
}

impl Samples {
    /// Sorts `samples`.
    pub(crate) fn new(mut samples: Vec<Duration>) -> Self {
        samples.sort_unstable();
        Samples { sorted: samples }
    }

    /// Number of samples.
    pub(crate) fn len(&self) -> usize {
        self.sorted.len()
    }

    /// True when nothing was measured.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }

    /// The nearest-rank percentile `p` (0–100): the smallest sample that at least `p` percent
    /// of the samples do not exceed. Zero for no samples.
    pub(crate) fn percentile(&self, p: f64) -> Duration {
        self.sorted
            .get(nearest_rank_index(self.sorted.len(), p))
            .copied()
            .unwrap_or_default()
    }

    /// The median.
    pub(crate) fn p50(&self) -> Duration {
        self.percentile(50.0)
    }

    /// The 99th percentile.
    pub(crate) fn p99(&self) -> Duration {
        self.percentile(99.0)
    }

    /// The largest sample.
    pub(crate) fn max(&self) -> Duration {
        self.sorted.last().copied().unwrap_or_default()
    }

    /// The sum of the samples.
    pub(crate) fn total(&self) -> Duration {
        self.sorted.iter().sum()
    }

    /// `p50 <ms> ms  p99 <ms> ms`, as the benchmarks' detail lines print a case.
    pub(crate) fn p50_p99_ms(&self) -> String {
        format!("p50 {} ms  p99 {} ms", ms(self.p50()), ms(self.p99()))
    }

    /// `p50 <ms> ms  p99 <ms> ms  max <ms> ms`.
    pub(crate) fn p50_p99_max_ms(&self) -> String {
        format!("{}  max {} ms", self.p50_p99_ms(), ms(self.max()))
    }
}

/// Index into `n` sorted samples of the nearest-rank percentile `p`: rank `ceil(p/100 * n)`,
/// at least 1.
pub(crate) fn nearest_rank_index(n: usize, p: f64) -> usize {
    if n == 0 {
        return 0;
    }
    let p = p.clamp(0.0, 100.0);
    // Exact for every n this crate measures (far below 2^52).
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    rank.clamp(1, n) - 1
}

/// Milliseconds with three decimals, e.g. `0.812`.
pub(crate) fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

/// Microseconds with one decimal, e.g. `41.7`.
pub(crate) fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

/// `a / b` with two decimals; `inf` when `b` is zero.
pub(crate) fn ratio(a: Duration, b: Duration) -> String {
    ratio_f(a.as_secs_f64(), b.as_secs_f64())
}

/// `a / b` with two decimals; `inf` when `b` is zero.
pub(crate) fn ratio_f(a: f64, b: f64) -> String {
    if b == 0.0 {
        "inf".to_owned()
    } else {
        format!("{:.2}", a / b)
    }
}

/// A share as percent with one decimal, e.g. `87.5`.
pub(crate) fn percent(share: f64) -> String {
    format!("{:.1}", share * 100.0)
}

/// Bytes as MiB with one decimal.
pub(crate) fn mib(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss)] // Memory sizes are far below 2^52.
    let mib = bytes as f64 / f64::from(1u32 << 20);
    format!("{mib:.1}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms_samples(values: &[u64]) -> Samples {
        Samples::new(values.iter().map(|&v| Duration::from_millis(v)).collect())
    }

    #[test]
    fn nearest_rank_percentiles() {
        let s = ms_samples(&[5, 1, 4, 2, 3]);
        assert_eq!(s.p50(), Duration::from_millis(3));
        assert_eq!(s.percentile(0.0), Duration::from_millis(1));
        assert_eq!(s.percentile(20.0), Duration::from_millis(1));
        assert_eq!(s.percentile(21.0), Duration::from_millis(2));
        assert_eq!(s.percentile(100.0), Duration::from_millis(5));
        assert_eq!(s.max(), Duration::from_millis(5));
        assert_eq!(s.total(), Duration::from_millis(15));
    }

    #[test]
    fn p99_of_a_hundred_is_the_99th_and_of_two_thousand_the_1980th() {
        let hundred: Vec<u64> = (1..=100).collect();
        assert_eq!(ms_samples(&hundred).p99(), Duration::from_millis(99));
        let many: Vec<u64> = (1..=2000).collect();
        assert_eq!(ms_samples(&many).p99(), Duration::from_millis(1980));
        assert_eq!(ms_samples(&many).p50(), Duration::from_secs(1));
    }

    #[test]
    fn empty_samples_are_zero() {
        let s = Samples::default();
        assert!(s.is_empty());
        assert_eq!(s.p99(), Duration::ZERO);
        assert_eq!(s.max(), Duration::ZERO);
    }

    #[test]
    fn formatting() {
        assert_eq!(ms(Duration::from_micros(812)), "0.812");
        assert_eq!(us(Duration::from_nanos(41_640)), "41.6");
        assert_eq!(
            ratio(Duration::from_millis(3), Duration::from_millis(2)),
            "1.50"
        );
        assert_eq!(ratio(Duration::from_millis(3), Duration::ZERO), "inf");
        assert_eq!(percent(0.875), "87.5");
        assert_eq!(mib(3 << 19), "1.5");
        let samples = Samples::new([3, 1, 2].map(Duration::from_millis).to_vec());
        assert_eq!(samples.p50_p99_ms(), "p50 2.000 ms  p99 3.000 ms");
        assert_eq!(
            samples.p50_p99_max_ms(),
            "p50 2.000 ms  p99 3.000 ms  max 3.000 ms"
        );
    }

    proptest! {
        #[test]
        fn a_percentile_is_a_sample_with_enough_samples_at_or_below_it(
            values in proptest::collection::vec(0u64..1000, 1..200),
            p in 0.0f64..=100.0,
        ) {
            let s = ms_samples(&values);
            let v = s.percentile(p);
            prop_assert!(s.sorted.contains(&v));
            let at_or_below = s.sorted.iter().filter(|&&x| x <= v).count();
            #[allow(clippy::cast_precision_loss)]
            let needed = (p / 100.0 * values.len() as f64).ceil();
            #[allow(clippy::cast_precision_loss)]
            let got = at_or_below as f64;
            prop_assert!(got >= needed);
            let below = s.sorted.iter().filter(|&&x| x < v).count();
            #[allow(clippy::cast_precision_loss)]
            let below = below as f64;
            prop_assert!(below < needed.max(1.0));
        }
    }
}
