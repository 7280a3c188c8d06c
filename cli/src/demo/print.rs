//! The report `kerf demo` prints on stdout once a run is over, and whether the run failed.

use std::fmt::Write as _;

use super::report::{self, Summary};

/// The whole report of a finished run: the node, classes, claims table, containers, device
/// health and the clean-up line, ending with the containers that failed, if any.
///
/// `run_containers` is whether containers were asked for, so that a run without them
/// mentions `--run-containers`.
#[must_use]
pub fn render_summary(summary: &Summary, run_containers: bool) -> String {
    let mut out = render_nodes(summary);
    out.push_str("classes:\n");
    out.push_str(&report::render_classes(summary));
    for problem in &summary.invalid_manifests {
        let _ = writeln!(out, "refused manifest: {problem}");
    }
    for ignored in &summary.ignored {
        let _ = writeln!(out, "ignored (kind not modelled by the demo): {ignored}");
    }
    let prepared = summary.claims.iter().filter(|c| c.prepared).count();
    let scheduled = summary.pods.iter().filter(|p| p.scheduled).count();
    let _ = writeln!(
        out,
        "\n{} claims, {prepared} prepared through the plugin's DRA socket for {scheduled} of {} pods:\n",
        summary.claims.len(),
        summary.pods.len()
    );
    out.push_str(&report::render_table(summary));
    out.push_str(
        "\nkerf-controller: kerf's real allocator. scheduler (emulated): kube-scheduler's \
         structured allocator (kerf-scheduler-standin: CEL selectors, constraints, counters, \
         capacity), first devices in ResourceSlice order.\n",
    );
    if let Some(root) = &summary.gpu_tools_root {
        let _ = writeln!(
            out,
            "MPS: one nvidia-cuda-mps-control daemon per GPU with MPS slices, the fake one of \
             this kerf binary in the mock driver root {}.",
            root.display()
        );
    }
    render_containers_part(&mut out, summary, run_containers);
    let daemons = if summary.gpu_tools_root.is_some() {
        "MPS daemons stopped, "
    } else {
        ""
    };
    out.push('\n');
    out.push_str(&report::render_health(summary));
    render_mig_part(&mut out, summary);
    let _ = writeln!(
        out,
        "\nall claims unprepared, {daemons}plugin stopped, sockets removed. Summary: {}",
        summary.output_dir.join("summary.json").display()
    );
    let failed = failed_containers(summary);
    if !failed.is_empty() {
        let _ = writeln!(out, "containers that failed: {}", failed.join(", "));
    }
    out
}

/// The nodes: the main one, the dynamic-MIG node and the node of shareable GPUs, with their
/// devices as published.
fn render_nodes(summary: &Summary) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(
        out,
        "node {} ({}), driver {}:",
        summary.node, summary.inventory, summary.driver
    );
    for device in &summary.devices {
        let _ = writeln!(out, "  {device}");
    }
    if let Some(mig) = &summary.mig_node {
        let _ = writeln!(
            out,
            "node {} ({}), dynamic MIG: partitionable devices (Kubernetes 1.36), {} ResourceSlices, {} of them counter sets only:",
            mig.node, mig.inventory, mig.slices, mig.counter_slices
        );
        for gpu in &mig.gpus {
            let _ = writeln!(out, "  {gpu}");
        }
    }
    if let Some(node) = &summary.shareable_node {
        let _ = writeln!(
            out,
            "node {} ({}), scheduler slices: GPUs published shareable (Kubernetes 1.36 consumable capacity):",
            node.node, node.inventory
        );
        for device in &node.devices {
            let _ = writeln!(out, "  {device}");
        }
    }
    for whole in &summary.published_whole {
        let _ = writeln!(out, "not shareable: {whole}");
    }
    out
}

/// The dynamic-MIG node's instances: created at prepare, none left after unprepare.
fn render_mig_part(out: &mut String, summary: &Summary) {
    let Some(mig) = &summary.mig_node else {
        return;
    };
    let _ = writeln!(
        out,
        "\nDynamic MIG on {}, in the emulated driver state under {}:",
        mig.node,
        mig.mig_state_root.display()
    );
    if mig.instances_prepared.is_empty() {
        out.push_str("  no MIG instance while the claims were prepared\n");
    }
    for instance in &mig.instances_prepared {
        let _ = writeln!(out, "  while prepared: {}", instance.text());
    }
    if mig.instances_left.is_empty() {
        out.push_str("  after unprepare: no MIG instance left\n");
    }
    for instance in &mig.instances_left {
        let _ = writeln!(out, "  LEFT after unprepare: {}", instance.text());
    }
}

/// The containers section: what each container saw, or why none ran.
fn render_containers_part(out: &mut String, summary: &Summary, run_containers: bool) {
    if let Some(runtime) = &summary.container_runtime {
        let _ = writeln!(out, "\ncontainers ({runtime}):");
        out.push_str(&report::render_containers(summary));
    }
    match &summary.containers_error {
        Some(error) => {
            let _ = writeln!(out, "\ncontainers not run: {error}");
        }
        None if !run_containers => {
            out.push_str("\n(--run-containers runs one busybox container per claim with podman)\n");
        }
        None => {}
    }
}

/// `namespace/name` of every claim whose container ran and did not exit with 0.
#[must_use]
pub fn failed_containers(summary: &Summary) -> Vec<String> {
    summary
        .claims
        .iter()
        .filter(|c| c.container.as_ref().is_some_and(|r| r.exit_code != Some(0)))
        .map(|c| format!("{}/{}", c.namespace, c.name))
        .collect()
}

/// Whether the run failed: containers were asked for but could not run, or one of them
/// failed.
#[must_use]
pub fn failed(summary: &Summary) -> bool {
    summary.containers_error.is_some() || !failed_containers(summary).is_empty()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::demo::containers::ContainerRun;
    use crate::demo::report::ClaimReport;

    fn claim(name: &str) -> ClaimReport {
        ClaimReport {
            namespace: "default".into(),
            name: name.into(),
            uid: None,
            origin: "x.yaml#1".into(),
            template: None,
            classes: vec![],
            pods: vec![],
            allocated_by: None,
            node: None,
            devices: vec![],
            prepared: true,
            error: None,
            cdi_spec_file: None,
            cdi_spec: None,
            container: None,
        }
    }

    /// A claim whose container ran and exited with `exit_code` (`None`: killed).
    fn ran(name: &str, exit_code: Option<i32>) -> ClaimReport {
        ClaimReport {
            container: Some(ContainerRun {
                command: "podman run".into(),
                exit_code,
                output: String::new(),
            }),
            ..claim(name)
        }
    }

    fn summary(claims: Vec<ClaimReport>) -> Summary {
        Summary {
            node: "n".into(),
            driver: "gpu.kerf.dev".into(),
            inventory: "mock profile l4".into(),
            devices: vec!["gpu-0 (NVIDIA L4, 24Gi)".into()],
            output_dir: PathBuf::from("/out"),
            classes: vec![],
            claims,
            pods: vec![],
            invalid_manifests: vec![],
            ignored: vec![],
            containers_error: None,
            container_runtime: None,
            gpu_tools_root: None,
            device_health: None,
            mig_node: None,
            shareable_node: None,
            published_whole: vec![],
        }
    }

    #[test]
    fn a_run_without_containers_suggests_them_and_succeeds() {
        let summary = summary(vec![claim("a")]);
        let text = render_summary(&summary, false);
        assert!(
            text.starts_with("node n (mock profile l4), driver gpu.kerf.dev:\n  gpu-0 (NVIDIA L4, 24Gi)\nclasses:\n"),
            "{text}"
        );
        assert!(
            text.contains("\n(--run-containers runs one busybox"),
            "{text}"
        );
        assert!(
            text.ends_with(
                "\nall claims unprepared, plugin stopped, sockets removed. Summary: /out/summary.json\n"
            ),
            "{text}"
        );
        assert!(!failed(&summary));
    }

    #[test]
    fn failed_containers_are_listed_last_and_fail_the_run() {
        let summary = summary(vec![
            ran("ok", Some(0)),
            ran("bad", Some(1)),
            ran("killed", None),
        ]);
        assert_eq!(
            failed_containers(&summary),
            ["default/bad", "default/killed"]
        );
        let text = render_summary(&summary, true);
        assert!(!text.contains("--run-containers"), "{text}");
        assert!(
            text.ends_with("containers that failed: default/bad, default/killed\n"),
            "{text}"
        );
        assert!(failed(&summary));
    }

    #[test]
    fn containers_that_could_not_run_fail_the_run() {
        let mut summary = summary(vec![claim("a")]);
        summary.containers_error = Some("podman is not installed".into());
        let text = render_summary(&summary, true);
        assert!(
            text.contains("\ncontainers not run: podman is not installed\n"),
            "{text}"
        );
        assert!(failed(&summary));
    }
}
