//! Workload inflation: the tasks one replay submits, in order.
//!
//! Imitates the paper's simulator (hkust-adsl/kubernetes-scheduler-simulator,
//! `pkg/simulator/simulator.go`): `SortClusterPods` sorts the trace's pods by name and
//! shuffles them (`--shuffle-pod=true`), then `TunePodsByNodeTotalResource` with ratio 1.3
//! (`-tune 1.3`, `experiments/run_scripts/generate_run_scripts.py`) either appends pods drawn
//! at random from the trace (`tuneUpPods`: draws until the next draw's GPU milli would pass
//! 1.3 × the cluster's GPU milli) or removes pods at random (`tuneDownPods`: until the total is
//! at most that). The random sequence is kerf's seeded one, not Go's `math/rand`, so seed 42
//! here is not the paper's seed 42: the figures compare as means over seeds.

use crate::rng::Rng;

use super::data::TaskRow;

/// GPU milli of one GPU.
pub(crate) const MILLI: u64 = 1000;

/// The GPU milli a task asks for per GPU (0 for a task without GPUs), as the simulator's
/// `GetPodResource` reads its `gpu-milli` annotation.
pub(crate) fn milli_per_gpu(task: &TaskRow) -> u64 {
    if task.num_gpu == 0 {
        0
    } else {
        u64::from(task.gpu_milli)
    }
}

/// The GPU milli a task asks for in all (`TotalMilliGpu`).
pub(crate) fn total_milli(task: &TaskRow) -> u64 {
    milli_per_gpu(task) * u64::from(task.num_gpu)
}

/// The tasks submitted by the replay with `seed`, as indices into `tasks`: the trace shuffled,
/// then tuned to `ratio_percent` of `cluster_milli` GPU milli.
pub(crate) fn inflate(
    tasks: &[TaskRow],
    cluster_milli: u64,
    ratio_percent: u64,
    seed: u64,
) -> Vec<usize> {
    let mut by_name: Vec<usize> = (0..tasks.len()).collect();
    by_name.sort_by(|&a, &b| tasks[a].name.cmp(&tasks[b].name));
    let mut rng = Rng::new(seed);
    let mut order = by_name.clone();
    shuffle(&mut order, &mut rng);
    let target = cluster_milli * ratio_percent / 100;
    let mut total: u64 = order.iter().map(|&t| total_milli(&tasks[t])).sum();
    if total > target {
        while total > target && !order.is_empty() {
            let at = rng.index(order.len());
            total -= total_milli(&tasks[order.remove(at)]);
        }
    } else if !by_name.is_empty() {
        loop {
            let drawn = by_name[rng.index(by_name.len())];
            // tuneUpPods compares the draw's milli per GPU, then adds its total.
            if total + milli_per_gpu(&tasks[drawn]) > target {
                break;
            }
            total += total_milli(&tasks[drawn]);
            order.push(drawn);
        }
    }
    order
}

/// Fisher–Yates, as Go's `rand.Shuffle`.
fn shuffle(items: &mut [usize], rng: &mut Rng) {
    for i in (1..items.len()).rev() {
        let j = rng.index(i + 1);
        items.swap(i, j);
    }
}

/// A random permutation of `0..n`.
pub(crate) fn permutation(n: usize, rng: &mut Rng) -> Vec<usize> {
    let mut items: Vec<usize> = (0..n).collect();
    shuffle(&mut items, rng);
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(name: &str, num_gpu: u32, gpu_milli: u32) -> TaskRow {
        TaskRow {
            name: name.into(),
            milli_cpu: 1000,
            memory_mib: 1024,
            num_gpu,
            gpu_milli,
            gpu_spec: Vec::new(),
        }
    }

    #[test]
    fn inflation_fills_to_the_ratio_and_keeps_every_original_task() {
        let tasks = vec![task("a", 1, 500), task("b", 2, 1000), task("c", 0, 0)];
        let order = inflate(&tasks, 10 * MILLI, 130, 42);
        let total: u64 = order.iter().map(|&t| total_milli(&tasks[t])).sum();
        assert!(total <= 13 * MILLI, "{total}");
        // The next draw would have passed the target by at most one GPU.
        assert!(total + MILLI > 13 * MILLI, "{total}");
        for t in 0..3 {
            assert!(order[..3].contains(&t), "{order:?}");
        }
        assert_eq!(order, inflate(&tasks, 10 * MILLI, 130, 42));
        assert_ne!(order, inflate(&tasks, 10 * MILLI, 130, 43));
    }

    #[test]
    fn a_trace_above_the_ratio_loses_random_tasks() {
        let tasks: Vec<TaskRow> = (0..20)
            .map(|i| task(&format!("t{i:02}"), 1, 1000))
            .collect();
        let order = inflate(&tasks, 10 * MILLI, 130, 1);
        assert_eq!(order.len(), 13);
    }
}
