//! A pod's effective requests from its containers' requests, as kube-scheduler totals them.
//!
//! Upstream: kubernetes/kubernetes `staging/src/k8s.io/component-helpers/resource/helpers.go`,
//! `PodRequests` (called by `noderesources/fit.go` `computePodResourceRequest`, and by the
//! scheduler cache for the pods on a node):
//! - `AggregateContainerRequests` → `aggregateContainerResourcesByFn`: the app containers are
//!   summed; each restartable init container (a sidecar, `restartPolicy: Always`) is added to
//!   that sum and to the running total of sidecars; every init container needs, while it runs,
//!   its own requests plus the sidecars started before it (a sidecar: the sidecars up to and
//!   including itself), and the pod needs at least the largest of these;
//! - pod-level requests (`spec.resources.requests`, PodLevelResources), when they name a
//!   supported resource (`IsPodLevelRequestsSet`), replace the containers' totals of the
//!   supported resources they name: cpu, memory and hugepages (`applyPodLevelResources`,
//!   `IsSupportedPodLevelResource`);
//! - the pod overhead (`spec.overhead`) is added last.
//!
//! Upstream adds `resource.Quantity` values and converts the total once; here each container's
//! quantities are converted first (milli CPU and bytes rounded up), so a pod whose containers
//! ask fractions of a millicore may total one millicore more than kube-scheduler counts.

use std::collections::BTreeMap;

use super::Resources;

/// An init container's requests, and whether it is restartable (a sidecar).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InitContainer {
    /// Its requests.
    pub requests: Resources,
    /// `restartPolicy: Always`: it keeps running beside the app containers.
    pub restartable: bool,
}

/// Pod-level requests (`spec.resources.requests`) of the resources pod-level resources
/// support: `None` where the pod does not name the resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodLevelRequests {
    /// `cpu`, in millicores.
    pub milli_cpu: Option<i64>,
    /// `memory`, in bytes.
    pub memory: Option<i64>,
    /// `hugepages-<size>`, in bytes, by resource name.
    pub hugepages: BTreeMap<String, i64>,
}

impl PodLevelRequests {
    /// True when a supported resource is named (upstream `IsPodLevelRequestsSet`).
    pub fn is_set(&self) -> bool {
        self.milli_cpu.is_some() || self.memory.is_some() || !self.hugepages.is_empty()
    }
}

/// What a pod's requests are made of, in plain amounts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodShape {
    /// The app containers' requests.
    pub containers: Vec<Resources>,
    /// The init containers, in order.
    pub init_containers: Vec<InitContainer>,
    /// `spec.overhead`.
    pub overhead: Option<Resources>,
    /// `spec.resources.requests` (PodLevelResources).
    pub pod_level: Option<PodLevelRequests>,
}

/// The pod's effective requests (upstream `PodRequests` with default options).
pub fn pod_requests(shape: &PodShape) -> Resources {
    let mut total = aggregate_containers(shape);
    if let Some(pod_level) = shape.pod_level.as_ref().filter(|p| p.is_set()) {
        if let Some(milli_cpu) = pod_level.milli_cpu {
            total.milli_cpu = milli_cpu;
        }
        if let Some(memory) = pod_level.memory {
            total.memory = memory;
        }
        for (name, bytes) in &pod_level.hugepages {
            total.scalars.insert(name.clone(), *bytes);
        }
    }
    if let Some(overhead) = &shape.overhead {
        total.add(overhead);
    }
    total
}

/// Upstream `aggregateContainerResourcesByFn` over the containers' spec requests.
fn aggregate_containers(shape: &PodShape) -> Resources {
    let mut total = Resources::default();
    for container in &shape.containers {
        total.add(container);
    }
    let mut sidecars = Resources::default();
    let mut init_peak = Resources::default();
    for init in &shape.init_containers {
        if init.restartable {
            total.add(&init.requests);
            sidecars.add(&init.requests);
            init_peak.max_with(&sidecars);
        } else {
            let mut running = init.requests.clone();
            running.add(&sidecars);
            init_peak.max_with(&running);
        }
    }
    total.max_with(&init_peak);
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu_mem(milli_cpu: i64, memory: i64) -> Resources {
        Resources::cpu_memory(milli_cpu, memory)
    }

    fn init(requests: Resources, restartable: bool) -> InitContainer {
        InitContainer {
            requests,
            restartable,
        }
    }

    #[test]
    fn app_containers_add_up() {
        let shape = PodShape {
            containers: vec![cpu_mem(2000, 1 << 30), cpu_mem(1000, 1 << 30)],
            ..PodShape::default()
        };
        assert_eq!(pod_requests(&shape), cpu_mem(3000, 2 << 30));
    }

    /// The example of upstream `computePodResourceRequest`'s doc comment: init containers of
    /// 2 CPU / 1G and 2 CPU / 3G beside apps of 2 + 1 CPU and 1G + 1G: 3 CPU, 3G.
    #[test]
    fn init_containers_count_by_their_largest() {
        let shape = PodShape {
            containers: vec![cpu_mem(2000, 1_000), cpu_mem(1000, 1_000)],
            init_containers: vec![
                init(cpu_mem(2000, 1_000), false),
                init(cpu_mem(2000, 3_000), false),
            ],
            ..PodShape::default()
        };
        assert_eq!(pod_requests(&shape), cpu_mem(3000, 3_000));
    }

    #[test]
    fn an_init_container_larger_than_the_apps_sets_the_request() {
        let shape = PodShape {
            containers: vec![cpu_mem(1000, 0)],
            init_containers: vec![init(cpu_mem(8000, 0), false)],
            ..PodShape::default()
        };
        assert_eq!(pod_requests(&shape).milli_cpu, 8000);
    }

    /// Sidecars run beside the apps (summed) and beside the init containers that start after
    /// them: KEP-753's example of resources calculation.
    #[test]
    fn sidecars_are_summed_with_the_apps_and_the_later_init_containers() {
        let shape = PodShape {
            containers: vec![cpu_mem(1000, 0)],
            init_containers: vec![
                init(cpu_mem(500, 0), true),
                init(cpu_mem(2000, 0), false),
                init(cpu_mem(300, 0), true),
            ],
            ..PodShape::default()
        };
        // Apps 1000 + sidecars 500 + 300 = 1800; the init container needs 2000 + 500 = 2500.
        assert_eq!(pod_requests(&shape).milli_cpu, 2500);
        let small_init = PodShape {
            init_containers: vec![
                init(cpu_mem(500, 0), true),
                init(cpu_mem(100, 0), false),
                init(cpu_mem(300, 0), true),
            ],
            ..shape
        };
        assert_eq!(pod_requests(&small_init).milli_cpu, 1800);
    }

    #[test]
    fn overhead_is_added_after_everything() {
        let mut overhead = cpu_mem(250, 120 << 20);
        overhead.ephemeral_storage = 1;
        let shape = PodShape {
            containers: vec![cpu_mem(1000, 1 << 30)],
            init_containers: vec![init(cpu_mem(4000, 0), false)],
            overhead: Some(overhead),
            ..PodShape::default()
        };
        let requests = pod_requests(&shape);
        assert_eq!(requests.milli_cpu, 4250);
        assert_eq!(requests.memory, (1 << 30) + (120 << 20));
        assert_eq!(requests.ephemeral_storage, 1);
    }

    #[test]
    fn pod_level_requests_replace_the_containers_cpu_and_memory_only() {
        let mut container = cpu_mem(1000, 1 << 30);
        container.ephemeral_storage = 5;
        container.scalars.insert("example.com/nic".into(), 2);
        let shape = PodShape {
            containers: vec![container],
            overhead: Some(cpu_mem(100, 0)),
            pod_level: Some(PodLevelRequests {
                milli_cpu: Some(4000),
                memory: None,
                hugepages: BTreeMap::from([("hugepages-2Mi".to_owned(), 4 << 20)]),
            }),
            ..PodShape::default()
        };
        let requests = pod_requests(&shape);
        assert_eq!(requests.milli_cpu, 4100, "pod level, then the overhead");
        assert_eq!(requests.memory, 1 << 30, "not named at pod level");
        assert_eq!(requests.ephemeral_storage, 5);
        assert_eq!(requests.scalars["example.com/nic"], 2);
        assert_eq!(requests.scalars["hugepages-2Mi"], 4 << 20);
        let unset = PodShape {
            pod_level: Some(PodLevelRequests::default()),
            ..shape
        };
        assert_eq!(pod_requests(&unset).milli_cpu, 1100);
    }
}
