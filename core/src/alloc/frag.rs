//! Fragmentation: how much of a node's free GPU capacity the pods the cluster runs could not
//! use, given how often each kind of pod arrives.
//!
//! The measure is the one of "Beware of Fragmentation" (Weng et al., USENIX ATC '23), as its
//! simulator computes it (hkust-adsl/kubernetes-scheduler-simulator, `pkg/utils/frag.go`,
//! `NodeGpuShareFragAmount`): for each kind of pod, weighted by how often it arrives, the
//! node's free GPU capacity that pod could not use is fragment: all of it when the pod needs
//! no GPU, may not use the node's GPUs, or does not fit the node (its GPUs, or its CPU or
//! memory); when it fits, the free capacity of the GPUs too small for it. kerf measures GPU
//! capacity as the free *share* of each GPU (the smaller of its free memory and free compute
//! fractions, 0–1, so a GPU counts as one), sizes pods in kerf's terms (whole GPUs, or slices
//! of memory and compute, with a selector) and checks node memory as well as CPU.
//!
//! [`Distribution`] is the weighted set of pod kinds, learned online by
//! [`Workload`](super::Workload); [`node_fragmentation`] measures a node of the
//! [`Index`](super::Index) against it.

use super::index::{GpuEntry, GpuFree, Index, NodeEntry};
use super::node_fit::NodeResources;
use super::request::{GpuSelector, SliceSize};

/// What a pod takes from its node besides GPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct HostAmounts {
    /// CPU in millicores.
    pub milli_cpu: i64,
    /// Memory in bytes.
    pub memory: i64,
}

impl HostAmounts {
    /// `self − other`, saturating.
    #[must_use]
    pub fn minus(self, other: HostAmounts) -> HostAmounts {
        HostAmounts {
            milli_cpu: self.milli_cpu.saturating_sub(other.milli_cpu),
            memory: self.memory.saturating_sub(other.memory),
        }
    }
}

/// A node's CPU and memory as kube-scheduler counts them: allocatable, and what its pods
/// (bound, nominated or assumed) request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostState {
    /// `status.allocatable`.
    pub allocatable: HostAmounts,
    /// Sum of the requests of the node's pods.
    pub requested: HostAmounts,
}

impl HostState {
    /// Allocatable minus requested.
    pub fn free(&self) -> HostAmounts {
        self.allocatable.minus(self.requested)
    }
}

impl From<&NodeResources> for HostState {
    fn from(node: &NodeResources) -> Self {
        HostState {
            allocatable: HostAmounts {
                milli_cpu: node.allocatable.milli_cpu,
                memory: node.allocatable.memory,
            },
            requested: HostAmounts {
                milli_cpu: node.requested.milli_cpu,
                memory: node.requested.memory,
            },
        }
    }
}

/// One kind of pod: what it asks of GPUs and of its node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct TaskShape {
    /// GPUs per pod, on one node; 0 for a pod without GPUs.
    pub gpus: u32,
    /// The share of each GPU; `None` for whole GPUs.
    pub slice: Option<SliceSize>,
    /// Which GPUs it may use.
    pub selector: GpuSelector,
    /// CPU and memory it requests of its node.
    pub host: HostAmounts,
}

/// The GPU part of a pod kind, and every host size it comes with.
#[derive(Debug, Clone)]
pub(super) struct Group {
    pub(super) gpus: u32,
    pub(super) slice: Option<SliceSize>,
    pub(super) selector: GpuSelector,
    /// (host amounts, weight), by CPU.
    pub(super) hosts: Vec<(HostAmounts, f64)>,
    /// Sum of the hosts' weights.
    pub(super) weight: f64,
}

/// Pod kinds with their share of arrivals (summing to 1), grouped for fast measurement.
///
/// Built by [`Workload::distribution`](super::Workload::distribution), or directly from
/// weighted shapes with [`Distribution::new`].
#[derive(Debug, Clone, Default)]
pub struct Distribution {
    pub(super) groups: Vec<Group>,
    /// Share of pods without GPUs: all free GPU capacity is fragment to them.
    pub(super) no_gpu: f64,
    /// The mean pod without GPUs (what it takes from its node), when there are such pods.
    pub(super) no_gpu_host: Option<HostAmounts>,
    /// CPU millicores and memory bytes the pods with GPUs ask per GPU they take (a slice
    /// counts its compute share of a GPU), averaged over the distribution.
    pub(super) per_gpu: Option<(f64, f64)>,
    version: u64,
}

impl Distribution {
    /// The distribution of `shapes` with their weights (any positive scale); shapes with a
    /// weight of zero or less are left out. Empty when nothing is left.
    pub fn new(shapes: impl IntoIterator<Item = (TaskShape, f64)>, version: u64) -> Self {
        let mut groups: Vec<Group> = Vec::new();
        let mut sums = Sums::default();
        for (shape, weight) in shapes {
            if weight.is_nan() || weight <= 0.0 {
                continue;
            }
            sums.add(&shape, weight);
            if shape.gpus == 0 {
                continue;
            }
            let at = groups.iter().position(|g| {
                g.gpus == shape.gpus && g.slice == shape.slice && g.selector == shape.selector
            });
            let group = if let Some(at) = at {
                &mut groups[at]
            } else {
                groups.push(Group {
                    gpus: shape.gpus,
                    slice: shape.slice,
                    selector: shape.selector,
                    hosts: Vec::new(),
                    weight: 0.0,
                });
                let last = groups.len() - 1;
                &mut groups[last]
            };
            group.hosts.push((shape.host, weight));
        }
        if sums.total > 0.0 {
            for group in &mut groups {
                for (_, weight) in &mut group.hosts {
                    *weight /= sums.total;
                }
                group.weight = group.hosts.iter().map(|(_, w)| w).sum();
                group
                    .hosts
                    .sort_by_key(|(host, _)| (host.milli_cpu, host.memory));
            }
        }
        Distribution {
            groups,
            no_gpu: sums.share(sums.no_gpu),
            no_gpu_host: sums.no_gpu_host(),
            per_gpu: sums.per_gpu(),
            version,
        }
    }

    /// True when no pod kind is known: every node measures zero.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty() && self.no_gpu == 0.0
    }

    /// Changes whenever the workload it was built from is rebuilt into a different
    /// distribution (caches of measurements key on it).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The pod kinds and their shares, as given (shares normalized).
    pub fn shapes(&self) -> impl Iterator<Item = (TaskShape, f64)> + '_ {
        let no_gpu = (self.no_gpu > 0.0).then(|| {
            let host = self.no_gpu_host.unwrap_or_default();
            (
                TaskShape {
                    host,
                    ..TaskShape::default()
                },
                self.no_gpu,
            )
        });
        self.groups
            .iter()
            .flat_map(|g| {
                g.hosts.iter().map(|(host, weight)| {
                    (
                        TaskShape {
                            gpus: g.gpus,
                            slice: g.slice,
                            selector: g.selector.clone(),
                            host: *host,
                        },
                        *weight,
                    )
                })
            })
            .chain(no_gpu)
    }
}

/// Weighted sums over the shapes of a distribution.
#[derive(Default)]
struct Sums {
    total: f64,
    no_gpu: f64,
    no_gpu_cpu: f64,
    no_gpu_memory: f64,
    gpus: f64,
    gpu_cpu: f64,
    gpu_memory: f64,
}

impl Sums {
    #[allow(clippy::cast_precision_loss)] // requests are far below 2^52
    fn add(&mut self, shape: &TaskShape, weight: f64) {
        self.total += weight;
        let (cpu, memory) = (shape.host.milli_cpu as f64, shape.host.memory as f64);
        if shape.gpus == 0 {
            self.no_gpu += weight;
            self.no_gpu_cpu += weight * cpu;
            self.no_gpu_memory += weight * memory;
        } else {
            let share = shape
                .slice
                .map_or(1.0, |s| f64::from(s.compute_percent.max(1)) / 100.0);
            self.gpus += weight * f64::from(shape.gpus) * share;
            self.gpu_cpu += weight * cpu;
            self.gpu_memory += weight * memory;
        }
    }

    fn share(&self, part: f64) -> f64 {
        if self.total > 0.0 {
            part / self.total
        } else {
            0.0
        }
    }

    #[allow(clippy::cast_possible_truncation)] // means of i64 amounts
    fn no_gpu_host(&self) -> Option<HostAmounts> {
        (self.no_gpu > 0.0).then(|| HostAmounts {
            milli_cpu: (self.no_gpu_cpu / self.no_gpu) as i64,
            memory: (self.no_gpu_memory / self.no_gpu) as i64,
        })
    }

    fn per_gpu(&self) -> Option<(f64, f64)> {
        (self.gpus > 0.0).then(|| (self.gpu_cpu / self.gpus, self.gpu_memory / self.gpus))
    }
}

/// A node's fragmentation against a [`Distribution`], in GPUs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fragmentation {
    /// Free GPU capacity of the node: each GPU's free share (the smaller of its free memory
    /// and free compute fractions), summed.
    pub free_gpus: f64,
    /// The part of it the expected pod could not use (FGD's measure): per pod kind, weighted
    /// by its share, all of the free capacity when the kind does not fit the node, else the
    /// free capacity of the GPUs too small for it.
    pub fragmented_gpus: f64,
    /// The part of it the node's free CPU and memory cannot feed: free GPUs beyond what the
    /// free CPU (and memory) would serve at the workload's CPU (and memory) per GPU.
    pub stranded_gpus: f64,
}

impl Fragmentation {
    /// `fragmented_gpus / free_gpus`, 0 for a node without free capacity.
    pub fn ratio(&self) -> f64 {
        if self.free_gpus > 0.0 {
            self.fragmented_gpus / self.free_gpus
        } else {
            0.0
        }
    }
}

/// Weight of [`Fragmentation::stranded_gpus`] against `fragmented_gpus` in what the
/// LeastFragmentation policy minimizes (measured on the openb trace: 0.3–1 alike).
pub(super) const STRANDED_WEIGHT: f64 = 0.5;

/// The free state of one GPU as the measure sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct FreeGpu {
    /// Free memory in bytes, free compute in percent; both 0 when held whole.
    pub(super) memory: u64,
    pub(super) compute: u8,
    /// No claim uses it.
    pub(super) idle: bool,
    /// Free share, 0–1.
    pub(super) share: f64,
}

impl FreeGpu {
    pub(super) fn new(free: &GpuFree, total_memory: u64) -> Self {
        #[allow(clippy::cast_precision_loss)]
        let memory_share = if total_memory == 0 {
            0.0
        } else {
            (free.memory as f64 / total_memory as f64).min(1.0)
        };
        FreeGpu {
            memory: free.memory,
            compute: free.compute,
            idle: free.idle,
            share: memory_share.min(f64::from(free.compute) / 100.0),
        }
    }

    /// Whether one GPU's part of `group` fits here.
    pub(super) fn fits(&self, group: &Group) -> bool {
        match group.slice {
            None => self.idle,
            Some(size) => self.memory >= size.memory_bytes && self.compute >= size.compute_percent,
        }
    }
}

impl Distribution {
    /// The fragmentation of a node state: its GPUs `gpus` (free states; `entries` the same
    /// GPUs' inventory, for selectors) and its free CPU and memory `host` (`None`: unknown,
    /// every kind fits them and nothing is stranded).
    pub(super) fn measure(
        &self,
        entries: &[GpuEntry],
        gpus: &[FreeGpu],
        host: Option<HostAmounts>,
    ) -> Fragmentation {
        let free: f64 = gpus.iter().map(|g| g.share).sum();
        let mut usable = 0.0;
        let mut weight = self.no_gpu;
        for group in &self.groups {
            weight += group.weight;
            let any_gpu = group.selector.is_empty();
            let mut fitting = 0;
            let mut fitting_share = 0.0;
            for (gpu, entry) in gpus.iter().zip(entries) {
                if gpu.fits(group) && (any_gpu || group.selector.matches(&entry.info)) {
                    fitting += 1;
                    fitting_share += gpu.share;
                }
            }
            if fitting < group.gpus {
                continue;
            }
            let hosted: f64 = match host {
                None => group.weight,
                Some(free) => group
                    .hosts
                    .iter()
                    .take_while(|(h, _)| h.milli_cpu <= free.milli_cpu)
                    .filter(|(h, _)| h.memory <= free.memory)
                    .map(|(_, w)| w)
                    .sum(),
            };
            usable += hosted * fitting_share;
        }
        Fragmentation {
            free_gpus: free,
            fragmented_gpus: (free * weight - usable).max(0.0),
            stranded_gpus: host.map_or(0.0, |h| self.stranded(free, h)),
        }
    }

    /// Free GPUs beyond what `host` can feed at the workload's CPU and memory per GPU.
    #[allow(clippy::cast_precision_loss)]
    pub(super) fn stranded(&self, free_gpus: f64, host: HostAmounts) -> f64 {
        let Some((cpu, memory)) = self.per_gpu else {
            return 0.0;
        };
        let mut fed = free_gpus;
        if cpu > 0.0 {
            fed = fed.min(host.milli_cpu.max(0) as f64 / cpu);
        }
        if memory > 0.0 {
            fed = fed.min(host.memory.max(0) as f64 / memory);
        }
        free_gpus - fed
    }
}

/// Node `node`'s current fragmentation against `dist`, with the node's free CPU and memory
/// `host` (`None`: not known; every pod kind counts as fitting them and nothing as
/// stranded); `None` for a node the index does not know.
///
/// For a metric per node pool: [`Fragmentation::fragmented_gpus`] (with `free_gpus` and
/// `stranded_gpus` beside it) of each node, summed over a pool's nodes, against the
/// distribution of the controller's [`Workload`](super::Workload). Costs one pass over the
/// node's GPUs per GPU kind of the distribution.
pub fn node_fragmentation(
    index: &Index,
    node: &str,
    host: Option<HostAmounts>,
    dist: &Distribution,
) -> Option<Fragmentation> {
    let entry: &NodeEntry = index.entry(node)?;
    let gpus: Vec<FreeGpu> = entry
        .gpus
        .iter()
        .map(|g| FreeGpu::new(&g.free, g.info.memory_bytes))
        .collect();
    Some(dist.measure(&entry.gpus, &gpus, host))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::{DeviceUse, GpuInfo, NodeGpus};
    use crate::inventory::ComputeCapability;

    const GI: u64 = 1 << 30;

    fn gpu(device: &str, product: &str) -> GpuInfo {
        GpuInfo {
            device: device.into(),
            uuid: format!("GPU-{device}"),
            product: product.into(),
            memory_bytes: 80 * GI,
            multiprocessors: 132,
            compute_capability: ComputeCapability { major: 9, minor: 0 },
            nvlink_domain: None,
            pcie_root: None,
            numa: None,
            taints: Vec::new(),
        }
    }

    fn kind(gpus: u32, percent: u8, cpu: i64) -> TaskShape {
        TaskShape {
            gpus,
            slice: (percent < 100).then_some(SliceSize {
                memory_bytes: u64::from(percent) * 80 * GI / 100,
                compute_percent: percent,
            }),
            host: HostAmounts {
                milli_cpu: cpu,
                memory: 0,
            },
            ..TaskShape::default()
        }
    }

    /// One node of two H100s, the second half used by a slice.
    fn half_used() -> Index {
        let mut index = Index::new();
        index.upsert_node(NodeGpus {
            node: "n".into(),
            gpus: vec![gpu("gpu-0", "H100"), gpu("gpu-1", "H100")],
        });
        index.set_claim_usage("c", vec![DeviceUse::slice("n", "gpu-1", 40 * GI, 50)]);
        index
    }

    #[test]
    fn free_capacity_too_small_for_a_kind_is_its_fragment() {
        let dist = Distribution::new([(kind(1, 100, 0), 1.0), (kind(1, 60, 0), 1.0)], 1);
        let frag = node_fragmentation(&half_used(), "n", None, &dist).unwrap();
        // Free: 1 + 0.5 GPUs. Whole GPUs fit the idle GPU only, 60 % slices too: the half
        // GPU is fragment to both kinds.
        assert!((frag.free_gpus - 1.5).abs() < 1e-9);
        assert!((frag.fragmented_gpus - 0.5).abs() < 1e-9, "{frag:?}");
        assert!((frag.ratio() - 1.0 / 3.0).abs() < 1e-9);
        assert!(frag.stranded_gpus.abs() < 1e-12);
        assert!(node_fragmentation(&half_used(), "other", None, &dist).is_none());
    }

    #[test]
    fn kinds_that_do_not_fit_the_node_count_all_free_capacity() {
        // Two-GPU pods need two whole GPUs; pods without GPUs use none of it.
        let dist = Distribution::new([(kind(2, 100, 0), 3.0), (kind(0, 100, 500), 1.0)], 1);
        let frag = node_fragmentation(&half_used(), "n", None, &dist).unwrap();
        assert!((frag.fragmented_gpus - 1.5).abs() < 1e-9, "{frag:?}");
        // A kind whose CPU the node lacks does not fit either.
        let dist = Distribution::new([(kind(1, 50, 8000), 1.0)], 1);
        let short = HostAmounts {
            milli_cpu: 4000,
            memory: 0,
        };
        let frag = node_fragmentation(&half_used(), "n", Some(short), &dist).unwrap();
        assert!((frag.fragmented_gpus - 1.5).abs() < 1e-9, "{frag:?}");
        let ample = HostAmounts {
            milli_cpu: 64_000,
            memory: 1 << 40,
        };
        let frag = node_fragmentation(&half_used(), "n", Some(ample), &dist).unwrap();
        assert!(frag.fragmented_gpus.abs() < 1e-9, "{frag:?}");
    }

    #[test]
    fn gpus_the_free_cpu_cannot_feed_are_stranded() {
        // 8 CPUs per GPU on average: 4 CPUs free feed half a GPU of the 1.5 free.
        let dist = Distribution::new([(kind(1, 100, 8000), 1.0), (kind(1, 50, 4000), 1.0)], 1);
        assert_eq!(dist.per_gpu, Some((8000.0, 0.0)));
        let host = HostAmounts {
            milli_cpu: 4000,
            memory: 0,
        };
        let frag = node_fragmentation(&half_used(), "n", Some(host), &dist).unwrap();
        assert!((frag.stranded_gpus - 1.0).abs() < 1e-9, "{frag:?}");
    }

    #[test]
    fn a_selector_keeps_a_kind_off_other_products() {
        let mut l4_only = kind(1, 100, 0);
        l4_only.selector.product_names = vec!["L4".into()];
        let dist = Distribution::new([(l4_only, 1.0)], 1);
        let frag = node_fragmentation(&half_used(), "n", None, &dist).unwrap();
        assert!((frag.fragmented_gpus - 1.5).abs() < 1e-9, "{frag:?}");
    }

    #[test]
    fn shares_are_normalized_and_pods_without_gpus_averaged() {
        let dist = Distribution::new(
            [
                (kind(1, 100, 1000), 2.0),
                (kind(0, 100, 2000), 1.0),
                (kind(0, 100, 4000), 1.0),
                (kind(1, 50, 1000), 0.0),
            ],
            7,
        );
        assert_eq!(dist.version(), 7);
        assert!(!dist.is_empty());
        let shapes: Vec<(TaskShape, f64)> = dist.shapes().collect();
        assert_eq!(shapes.len(), 2);
        assert!((shapes[0].1 - 0.5).abs() < 1e-9);
        assert_eq!(shapes[1].0.host.milli_cpu, 3000);
        assert!((shapes[1].1 - 0.5).abs() < 1e-9);
        assert!(Distribution::default().is_empty());
    }
}
