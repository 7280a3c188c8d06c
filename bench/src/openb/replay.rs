//! One replay: a trace's inflated tasks submitted one by one to a cluster, each placed at
//! once or failed, none ever leaving, and the allocation ratio recorded after each.

use std::collections::HashMap;

use kerf_core::alloc::node_fit::{NodeResources, Resources, insufficient_resources};
use kerf_core::alloc::{
    HostAmounts, HostState, Index, PlacementContext, Policy, TaskShape, Workload, place_where_with,
    place_without_gpus, wants_idle_gpus_taint,
};

use crate::rng::Rng;

use super::cluster::{Cluster, host_request};
use super::curve::{Curve, Recorder};
use super::data::TaskRow;
use super::fgd::{FgdState, PodShape, TypicalPods};
use super::inflate::{inflate, total_milli};
use super::kube;

/// Who places the tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placer {
    /// kerf's default: LeastFragmentation as [`Placer::Kerf`] places it, and kerf's
    /// `PreferNoSchedule` taint ([`wants_idle_gpus_taint`]) on the nodes with an idle GPU,
    /// which kube-scheduler's TaintToleration score ([`kube::taint_toleration`]) counts when
    /// it places the tasks without GPUs.
    KerfTainted,
    /// kerf's allocator (`place_where_with`, with the node's CPU and memory fit as
    /// candidates) under this policy; tasks without GPUs where kube-scheduler's default
    /// scoring puts them.
    Kerf(Policy),
    /// kerf's LeastFragmentation for every task, tasks without GPUs by
    /// `place_without_gpus`: the paper's setting, where one policy places all tasks.
    KerfAll,
    /// The FGD port ([`super::fgd`]); tasks without GPUs by FGD's score too, as in the
    /// paper's simulator.
    Fgd,
    /// The FGD port for GPU tasks; tasks without GPUs where kube-scheduler puts them, as
    /// for kerf.
    FgdKube,
}

impl Placer {
    /// The name printed in tables.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Placer::KerfTainted => "kerf default (idle-GPU taint)",
            Placer::Kerf(Policy::LeastFragmentation) => "kerf default, no taint",
            Placer::KerfAll => "kerf LeastFragmentation, all tasks",
            Placer::Kerf(Policy::BinPack) => "kerf BinPack",
            Placer::Kerf(Policy::Spread) => "kerf Spread",
            Placer::Fgd => "FGD (port)",
            Placer::FgdKube => "FGD (port), CPU tasks by kube",
        }
    }

    /// The name in figure keys.
    pub(crate) fn key(self) -> &'static str {
        match self {
            Placer::KerfTainted => "leastfrag_taint",
            Placer::Kerf(Policy::LeastFragmentation) => "leastfrag",
            Placer::KerfAll => "leastfrag_all",
            Placer::Kerf(Policy::BinPack) => "binpack",
            Placer::Kerf(Policy::Spread) => "spread",
            Placer::Fgd => "fgd",
            Placer::FgdKube => "fgd_kube",
        }
    }
}

/// What every replay of one trace shares.
#[derive(Debug)]
pub(crate) struct TraceInput {
    pub(crate) cluster: Cluster,
    pub(crate) tasks: Vec<TaskRow>,
    /// The cluster's GPU models, by model id.
    pub(crate) models: Vec<String>,
    /// Model id of each node.
    pub(crate) node_model: Vec<usize>,
    /// FGD's shape id of each task, and the shapes.
    pub(crate) shape_ids: Vec<u32>,
    pub(crate) shapes: Vec<PodShape>,
    pub(crate) typical: TypicalPods,
}

impl TraceInput {
    /// The input of a trace's replays.
    pub(crate) fn new(cluster: Cluster, tasks: Vec<TaskRow>) -> Self {
        let mut models: Vec<String> = cluster.nodes.iter().map(|n| n.model.clone()).collect();
        models.sort();
        models.dedup();
        let node_model = cluster
            .nodes
            .iter()
            .map(|n| models.binary_search(&n.model).unwrap_or(0))
            .collect();
        let mut ids: HashMap<PodShape, u32> = HashMap::new();
        let mut shapes = Vec::new();
        let shape_ids = tasks
            .iter()
            .map(|task| {
                let shape = PodShape::of(task);
                *ids.entry(shape.clone()).or_insert_with(|| {
                    shapes.push(shape);
                    u32::try_from(shapes.len() - 1).unwrap_or(u32::MAX)
                })
            })
            .collect();
        let typical = TypicalPods::new(&tasks, &models);
        TraceInput {
            cluster,
            tasks,
            models,
            node_model,
            shape_ids,
            shapes,
            typical,
        }
    }
}

/// The CPU, memory and pods of every node, with the non-zero requests kube-scheduler scores.
pub(crate) struct Hosts {
    nodes: Vec<NodeResources>,
    non_zero: Vec<(i64, i64)>,
}

impl Hosts {
    fn new(cluster: &Cluster) -> Self {
        Hosts {
            nodes: (0..cluster.nodes.len())
                .map(|at| cluster.node_resources(at))
                .collect(),
            non_zero: vec![(0, 0); cluster.nodes.len()],
        }
    }

    /// Whether `pod` fits node `at`'s CPU, memory and pods (kube-scheduler's
    /// NodeResourcesFit, as kerf's controller computes it).
    pub(crate) fn fits(&self, at: usize, pod: &Resources) -> bool {
        insufficient_resources(pod, &self.nodes[at], |_| false).is_empty()
    }

    fn add(&mut self, at: usize, pod: &Resources) {
        self.nodes[at].add_pod(pod);
        let (cpu, memory) = kube::non_zero(pod);
        self.non_zero[at].0 += cpu;
        self.non_zero[at].1 += memory;
    }

    /// Where kube-scheduler puts a pod without GPUs, given the `PreferNoSchedule` taints it
    /// does not tolerate per node (none where `taints` is short).
    fn kube_choice(&self, pod: &Resources, taints: &[u32], rng: &mut Rng) -> Option<usize> {
        let taint = |at: usize| taints.get(at).copied().unwrap_or(0);
        let fitting: Vec<usize> = (0..self.nodes.len())
            .filter(|&at| self.fits(at, pod))
            .collect();
        // TaintToleration normalizes over the nodes it scores: those that passed the filters.
        let most = fitting.iter().map(|&at| taint(at)).max().unwrap_or(0);
        kube::select(
            fitting.into_iter().map(|at| {
                let resources = kube::score(pod, &self.nodes[at], self.non_zero[at]);
                let taints = kube::taint_toleration(taint(at), most);
                (at, resources + kube::TAINT_TOLERATION_WEIGHT * taints)
            }),
            rng,
        )
    }
}

/// Replays `input`'s trace inflated with `seed` under `placer`.
pub(crate) fn replay(input: &TraceInput, placer: Placer, seed: u64) -> Curve {
    let order = inflate(&input.tasks, input.cluster.milli(), 130, seed);
    let mut run = Run {
        input,
        placer,
        hosts: Hosts::new(&input.cluster),
        ties: Rng::new(seed ^ 0x6b75_6265),
        state: match placer {
            Placer::KerfTainted => State::Kerf(Box::new(KerfState::new(
                &input.cluster,
                Policy::LeastFragmentation,
                Pods::KubeTainted,
            ))),
            Placer::Kerf(policy) => {
                State::Kerf(Box::new(KerfState::new(&input.cluster, policy, Pods::Kube)))
            }
            Placer::KerfAll => State::Kerf(Box::new(KerfState::new(
                &input.cluster,
                Policy::LeastFragmentation,
                Pods::Kerf,
            ))),
            Placer::Fgd | Placer::FgdKube => State::Fgd(FgdState::new(input, seed)),
        },
        recorder: Recorder::new(input.cluster.milli()),
        arrived: 0,
        used: 0,
    };
    for (seq, &t) in order.iter().enumerate() {
        run.submit(seq, t);
    }
    run.recorder.finish()
}

/// One replay in progress.
struct Run<'a> {
    input: &'a TraceInput,
    placer: Placer,
    hosts: Hosts,
    /// kube-scheduler's choices among equal scores.
    ties: Rng,
    state: State,
    recorder: Recorder,
    /// GPU milli arrived and in use.
    arrived: u64,
    used: u64,
}

impl Run<'_> {
    /// Submits task `t`, the `seq`th of the replay: placed at once or failed.
    fn submit(&mut self, seq: usize, t: usize) {
        let input = self.input;
        let task = &input.tasks[t];
        let pod = host_request(task);
        let milli = total_milli(task);
        self.arrived += milli;
        let placed = match &mut self.state {
            State::Fgd(fgd) if milli > 0 || self.placer == Placer::Fgd => {
                fgd.place(input, t, &pod, &self.hosts)
            }
            State::Kerf(kerf) if milli > 0 => kerf.place(input, task, seq, &pod, &self.hosts),
            State::Kerf(kerf) if self.placer == Placer::KerfAll => {
                kerf.place_without_gpus(&pod, &self.hosts)
            }
            State::Kerf(kerf) => {
                kerf.observe_without_gpus(&pod);
                let taints = kerf.taints();
                self.hosts.kube_choice(&pod, &taints, &mut self.ties)
            }
            State::Fgd(fgd) => {
                let choice = self.hosts.kube_choice(&pod, &[], &mut self.ties);
                if let Some(at) = choice {
                    fgd.take_cpu(at, pod.milli_cpu);
                }
                choice
            }
        };
        if let Some(at) = placed {
            self.hosts.add(at, &pod);
            self.used += milli;
        }
        self.recorder.record(self.arrived, self.used);
    }
}

enum State {
    Kerf(Box<KerfState>),
    Fgd(FgdState),
}

/// What the pod requests of its node, in the allocator's terms.
fn host_amounts(pod: &Resources) -> HostAmounts {
    HostAmounts {
        milli_cpu: pod.milli_cpu,
        memory: pod.memory,
    }
}

/// Who places the tasks without GPUs in a kerf replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pods {
    /// kerf's policy (`place_without_gpus`).
    Kerf,
    /// kube-scheduler, on nodes without taints.
    Kube,
    /// kube-scheduler, with kerf's taint on the nodes with an idle GPU.
    KubeTainted,
}

/// kerf's index (its nodes named by their slot, see [`Cluster::node_gpus`]), the policy and
/// the workload learned so far.
struct KerfState {
    index: Index,
    policy: Policy,
    workload: Workload,
    /// Pods without GPUs are kube-scheduler's ([`PlacementContext::steer_pods_without_gpus`]).
    steer: bool,
    /// The nodes carry kerf's taint where [`wants_idle_gpus_taint`] says so.
    tainted: bool,
    /// Nodes of the cluster.
    nodes: usize,
}

/// The slot of an index node.
fn slot(name: &str) -> Option<usize> {
    name.parse().ok()
}

impl KerfState {
    fn new(cluster: &Cluster, policy: Policy, pods: Pods) -> Self {
        let mut index = Index::new();
        for at in 0..cluster.nodes.len() {
            index.upsert_node(cluster.node_gpus(at));
        }
        KerfState {
            index,
            policy,
            workload: Workload::default(),
            steer: pods != Pods::Kerf,
            tainted: pods == Pods::KubeTainted,
            nodes: cluster.nodes.len(),
        }
    }

    /// kerf's `PreferNoSchedule` taints per node slot (0 or 1), as the controller would
    /// keep them on the nodes when the next pod without GPUs is scheduled; empty when the
    /// nodes carry none.
    fn taints(&self) -> Vec<u32> {
        if !self.tainted {
            return Vec::new();
        }
        let mut taints = vec![0; self.nodes];
        for node in self.index.nodes() {
            if let Some(at) = slot(node.name()) {
                taints[at] = u32::from(wants_idle_gpus_taint(node));
            }
        }
        taints
    }

    fn place(
        &mut self,
        input: &TraceInput,
        task: &TaskRow,
        seq: usize,
        pod: &Resources,
        hosts: &Hosts,
    ) -> Option<usize> {
        let request = input
            .cluster
            .pod_request(task, format!("t{seq}"), self.policy)?;
        let host = host_amounts(pod);
        self.workload.observe(TaskShape::of(&request, host));
        let lookup = |name: &str| slot(name).map(|at| HostState::from(&hosts.nodes[at]));
        let ctx = PlacementContext {
            workload: self.workload.distribution(),
            pod: host,
            hosts: &lookup,
            steer_pods_without_gpus: self.steer,
        };
        let placement = place_where_with(
            &self.index,
            &request,
            |name| slot(name).is_some_and(|at| hosts.fits(at, pod)),
            &ctx,
        )
        .ok()?;
        self.index.apply(&placement);
        slot(&placement.node)
    }

    /// Shows the workload a task without GPUs.
    fn observe_without_gpus(&mut self, pod: &Resources) {
        self.workload.observe(TaskShape {
            host: host_amounts(pod),
            ..TaskShape::default()
        });
    }

    /// Places a task without GPUs by the LeastFragmentation policy.
    fn place_without_gpus(&mut self, pod: &Resources, hosts: &Hosts) -> Option<usize> {
        let host = host_amounts(pod);
        self.observe_without_gpus(pod);
        let lookup = |name: &str| slot(name).map(|at| HostState::from(&hosts.nodes[at]));
        let ctx = PlacementContext {
            workload: self.workload.distribution(),
            pod: host,
            hosts: &lookup,
            steer_pods_without_gpus: false,
        };
        let node = place_without_gpus(
            &self.index,
            |name| slot(name).is_some_and(|at| hosts.fits(at, pod)),
            &ctx,
        )?;
        slot(&node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openb::PLACERS;
    use crate::openb::data::NodeRow;

    fn node(name: &str, gpus: u32, cpu: i64) -> NodeRow {
        NodeRow {
            name: name.into(),
            milli_cpu: cpu,
            memory_mib: 262_144,
            gpus,
            model: "G2".into(),
        }
    }

    fn task(name: &str, cpu: i64, num_gpu: u32, gpu_milli: u32) -> TaskRow {
        TaskRow {
            name: name.into(),
            milli_cpu: cpu,
            memory_mib: 1024,
            num_gpu,
            gpu_milli,
            gpu_spec: Vec::new(),
        }
    }

    #[test]
    fn a_trace_that_fits_is_allocated_as_it_arrives_by_every_placer() {
        // 4 GPUs; four 1-GPU tasks are 100 %; inflation to 130 % adds one more, which fails.
        let cluster = Cluster::new(vec![node("a", 2, 32_000), node("b", 2, 32_000)]);
        let tasks = (0..4)
            .map(|i| task(&format!("t{i}"), 4000, 1, 1000))
            .collect();
        let input = TraceInput::new(cluster, tasks);
        for placer in PLACERS {
            let curve = replay(&input, placer, 42);
            assert_eq!(curve[25], Some(25.0), "{placer:?}");
            assert_eq!(curve[100], Some(100.0), "{placer:?}");
            assert_eq!(curve[125], Some(100.0), "{placer:?}");
            assert_eq!(curve[110], None, "{placer:?}");
        }
    }

    #[test]
    fn cpu_decides_too_and_shares_pack_gpus() {
        // One node's CPU fits only one 30-CPU task; shares of 500 milli pair up on a GPU.
        let cluster = Cluster::new(vec![node("a", 2, 40_000), node("b", 2, 8000)]);
        let tasks = vec![
            task("t0", 30_000, 1, 1000),
            task("t1", 30_000, 1, 1000),
            task("t2", 2000, 1, 500),
            task("t3", 2000, 1, 500),
        ];
        let input = TraceInput::new(cluster, tasks);
        for placer in PLACERS {
            let curve = replay(&input, placer, 7);
            // 3000 milli arrive (75 %); one 30-CPU task fails, whatever the order.
            assert_eq!(curve[75], Some(50.0), "{placer:?}");
        }
    }

    #[test]
    fn kerfs_taint_sends_pods_without_gpus_to_nodes_whose_gpus_are_used() {
        let cluster = Cluster::new(vec![node("a", 1, 32_000), node("b", 1, 32_000)]);
        let input = TraceInput::new(cluster, vec![task("gpu", 4000, 1, 1000)]);
        let cpu_pod = host_request(&task("cpu", 8000, 0, 0));
        for (pods, expect_used) in [(Pods::KubeTainted, true), (Pods::Kube, false)] {
            let mut hosts = Hosts::new(&input.cluster);
            let mut kerf = KerfState::new(&input.cluster, Policy::LeastFragmentation, pods);
            let gpu_pod = host_request(&input.tasks[0]);
            let used = kerf
                .place(&input, &input.tasks[0], 0, &gpu_pod, &hosts)
                .unwrap();
            hosts.add(used, &gpu_pod);
            let taints = kerf.taints();
            let choice = hosts.kube_choice(&cpu_pod, &taints, &mut Rng::new(1));
            if expect_used {
                assert_eq!(taints, [u32::from(used != 0), u32::from(used != 1)]);
                assert_eq!(choice, Some(used), "the other node keeps its idle GPU");
            } else {
                assert!(taints.is_empty());
                assert_eq!(
                    choice,
                    Some(1 - used),
                    "LeastAllocated alone: the idle node"
                );
            }
        }
    }
}
