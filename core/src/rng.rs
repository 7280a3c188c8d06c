//! A seeded random sequence (SplitMix64) for everything in kerf that draws "random" choices
//! it must be able to repeat: the scheduler stand-in's node choices and share IDs, the
//! benchmarks' workloads, and the randomised tests, whose failing seed must replay. It is
//! deterministic across platforms and releases, which a seeded test or benchmark needs and
//! `std` does not offer; it is not for secrets.
//!
//! SplitMix64 after Steele, Lea and Flood, "Fast splittable pseudorandom number generators"
//! (OOPSLA 2014), with the constants of its reference implementation (Vigna's
//! `splitmix64.c`).

/// A SplitMix64 sequence: the same seed gives the same numbers.
#[derive(Debug, Clone)]
pub struct SeededRng(u64);

impl SeededRng {
    /// A sequence starting from `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0), as the next number modulo `n`: the bias is
    /// irrelevant for the small `n` of test choices, and recorded seeds replay only while the
    /// mapping stays this one.
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        usize::try_from(self.next_u64() % (n as u64)).unwrap_or(0)
    }

    /// True `percent` times in a hundred.
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_is_fixed_by_the_seed() {
        let mut a = SeededRng::new(7);
        let first: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
        let mut b = SeededRng::new(7);
        assert_eq!(first, (0..4).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert_ne!(SeededRng::new(8).next_u64(), first[0]);
        // SplitMix64's published first outputs for seed 0 (splitmix64.c).
        let mut zero = SeededRng::new(0);
        assert_eq!(zero.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(zero.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = SeededRng::new(1);
        let mut seen = [false; 6];
        for _ in 0..1000 {
            seen[rng.below(6)] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(rng.below(0), 0);
        assert!((0..100).all(|_| !rng.chance(0) && rng.chance(100)));
    }
}
