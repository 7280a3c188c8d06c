//! The seeded claim workload of the allocator benchmarks: a realistic mix where slices
//! dominate, with whole GPUs and 2- and 4-GPU NVLink sets.

use kerf_core::alloc::{
    ClaimRequest, DeviceRequest, Index, NodeGpus, PodRequest, Policy, SliceSize, TopologyScope,
};
use kerf_core::inventory::Inventory;
use kerf_core::sharing::Sharing;

use crate::Result;
use crate::rng::Rng;

const GI: u64 = 1 << 30;

/// Shares of the claim shapes, in percent of claims; they add up to 100.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mix {
    /// One slice of one GPU.
    pub slice: u32,
    /// One whole GPU.
    pub whole_one: u32,
    /// Two whole GPUs in one NVLink domain.
    pub nvlink_two: u32,
    /// Four whole GPUs in one NVLink domain.
    pub nvlink_four: u32,
}

impl Default for Mix {
    /// 70 % slices, 15 % one GPU, 10 % two NVLink GPUs, 5 % four NVLink GPUs.
    fn default() -> Self {
        Mix {
            slice: 70,
            whole_one: 15,
            nvlink_two: 10,
            nvlink_four: 5,
        }
    }
}

/// Slice memory sizes drawn uniformly: 5Gi to 40Gi in steps of 5Gi.
pub(crate) const SLICE_MEMORY_GI: [u64; 8] = [5, 10, 15, 20, 25, 30, 35, 40];
/// Slice compute shares drawn uniformly, in percent.
pub(crate) const SLICE_COMPUTE_PERCENT: [u8; 5] = [10, 20, 30, 40, 50];

/// What one claim asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Shape {
    /// One slice.
    Slice(SliceSize),
    /// `count` whole GPUs, in one NVLink domain when `count` > 1.
    Whole {
        /// How many GPUs.
        count: u32,
    },
}

impl Shape {
    /// The claim's request, with `policy` for choosing among GPUs and nodes.
    pub(crate) fn request(self, policy: Policy) -> DeviceRequest {
        let mut request = match self {
            Shape::Slice(size) => {
                let mut r = DeviceRequest::slices("gpu", 1, size);
                r.sharing = Sharing::Mps;
                r
            }
            Shape::Whole { count } => {
                let mut r = DeviceRequest::whole("gpu", count);
                if count > 1 {
                    r.topology = TopologyScope::NvLink;
                }
                r
            }
        };
        request.policy = policy;
        request
    }

    /// A pod with one claim of this shape keyed `key`.
    pub(crate) fn pod(self, key: String, policy: Policy) -> PodRequest {
        PodRequest {
            claims: vec![ClaimRequest {
                key,
                requests: vec![self.request(policy)],
            }],
        }
    }
}

/// The seeded stream of claim shapes.
#[derive(Debug, Clone)]
pub(crate) struct Workload {
    rng: Rng,
    mix: Mix,
}

impl Workload {
    /// The stream for `seed` with mix `mix`.
    pub(crate) fn new(seed: u64, mix: Mix) -> Self {
        Workload {
            rng: Rng::new(seed),
            mix,
        }
    }

    /// The next claim's shape.
    pub(crate) fn next_shape(&mut self) -> Shape {
        let total =
            self.mix.slice + self.mix.whole_one + self.mix.nvlink_two + self.mix.nvlink_four;
        let roll = u32::try_from(self.rng.below(u64::from(total.max(1)))).unwrap_or(0);
        if roll < self.mix.slice {
            let memory = SLICE_MEMORY_GI[self.rng.index(SLICE_MEMORY_GI.len())];
            let compute = SLICE_COMPUTE_PERCENT[self.rng.index(SLICE_COMPUTE_PERCENT.len())];
            return Shape::Slice(SliceSize {
                memory_bytes: memory * GI,
                compute_percent: compute,
            });
        }
        let count = if roll < self.mix.slice + self.mix.whole_one {
            1
        } else if roll < self.mix.slice + self.mix.whole_one + self.mix.nvlink_two {
            2
        } else {
            4
        };
        Shape::Whole { count }
    }
}

/// A claim UID in RFC 4122 form, unique per `n`.
pub(crate) fn claim_uid(n: u64) -> String {
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        n & 0xffff_ffff,
        (n >> 32) & 0xffff,
        0xbe,
        0x0c,
        n.wrapping_mul(0x9E37_79B9_7F4A_7C15) & 0xffff_ffff_ffff
    )
}

/// Node `n`'s name.
pub(crate) fn node_name(n: usize) -> String {
    format!("node-{n:04}")
}

/// An index of `nodes` nodes with `profile`'s GPUs each and no usage.
///
/// # Errors
/// The profile is not a mock profile.
pub(crate) fn cluster(nodes: usize, profile: &str) -> Result<(Index, Inventory)> {
    let inventory = kerf_core::mock::from_spec(profile)?;
    let mut index = Index::new();
    for n in 0..nodes {
        index.upsert_node(NodeGpus::from_inventory(node_name(n), &inventory));
    }
    Ok((index, inventory))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_deterministic_and_follows_the_mix() {
        let shapes = |seed| {
            let mut w = Workload::new(seed, Mix::default());
            (0..10_000).map(|_| w.next_shape()).collect::<Vec<_>>()
        };
        let a = shapes(42);
        assert_eq!(a, shapes(42));
        assert_ne!(a, shapes(43));
        let slices = a.iter().filter(|s| matches!(s, Shape::Slice(_))).count();
        let fours = a
            .iter()
            .filter(|s| matches!(s, Shape::Whole { count: 4 }))
            .count();
        assert!((6_700..7_300).contains(&slices), "{slices} slices");
        assert!((350..650).contains(&fours), "{fours} four-GPU sets");
        for shape in &a {
            if let Shape::Slice(size) = shape {
                assert!((5 * GI..=40 * GI).contains(&size.memory_bytes));
                assert!((10..=50).contains(&size.compute_percent));
            }
        }
    }

    #[test]
    fn multi_gpu_sets_ask_for_one_nvlink_domain() {
        let r = Shape::Whole { count: 2 }.request(Policy::Spread);
        assert_eq!(r.topology, TopologyScope::NvLink);
        assert_eq!(r.policy, Policy::Spread);
        assert_eq!(
            Shape::Whole { count: 1 }.request(Policy::BinPack).topology,
            TopologyScope::Any
        );
    }

    #[test]
    fn uids_are_valid_and_distinct() {
        let a = claim_uid(1);
        assert_eq!(a.len(), 36);
        assert!(kerf_core::names::claim_uid("uid", &a).is_ok());
        assert_ne!(a, claim_uid(2));
        assert_ne!(claim_uid(5), claim_uid(5 + (1 << 32)));
    }
}
