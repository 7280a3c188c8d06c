//! A small, fast hasher for the index's string keys.
//!
//! Placement looks every candidate node up by name; with a thousand candidates per decision
//! SipHash's cost shows. This is the multiply-rotate scheme of rustc's FxHash, eight bytes at
//! a time, with a final mix. The keys are node names and claim UIDs: a client able to make them collide gains
//! slower decisions, nothing more.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct WordHasher(u64);

impl WordHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for WordHasher {
    fn finish(&self) -> u64 {
        // The multiply leaves entropy in the high bits; hashbrown indexes with the low ones,
        // so finish with splitmix64's mixer.
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, byte: u8) {
        self.add(u64::from(byte));
    }
}

/// A `HashMap` with [`WordHasher`].
pub(super) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<WordHasher>>;
