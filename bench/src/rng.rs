//! The benchmarks' random choices: [`kerf_core::rng::SeededRng`] (SplitMix64, deterministic
//! across platforms and releases, which is all a benchmark workload needs) with the
//! multiply-shift mapping to a range that the recorded workloads were drawn with.

use kerf_core::rng::SeededRng;

/// A seeded sequence with the benchmarks' mapping to a range.
#[derive(Debug, Clone)]
pub(crate) struct Rng(SeededRng);

impl Rng {
    /// A generator seeded with `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Rng(SeededRng::new(seed))
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// A number in `0..n` (0 when `n` is 0), by multiply-shift: no modulo bias worth
    /// mentioning for the small `n` used here. (Not [`SeededRng::below`], which takes the
    /// modulo: the workloads and their figures were drawn with this mapping.)
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        let wide = u128::from(self.next_u64()) * u128::from(n);
        u64::try_from(wide >> 64).unwrap_or(0)
    }

    /// An index into a slice of `len` elements (0 for an empty one).
    pub(crate) fn index(&mut self, len: usize) -> usize {
        usize::try_from(self.below(len as u64)).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_is_fixed_by_the_seed() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..4).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::new(7);
        let b: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
        assert_eq!(a, b);
        assert_ne!(Rng::new(8).next_u64(), a[0]);
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut r = Rng::new(1);
        let mut seen = [false; 6];
        for _ in 0..1000 {
            let v = r.below(6);
            assert!(v < 6);
            seen[usize::try_from(v).unwrap()] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(r.below(0), 0);
    }
}
