//! Assertions the tests share about one pod, its claim and what its container reported.
//! Pure functions over API objects, so they fail with words, never a panic.

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kerf_api::ownership::Owner;

use super::checks::{self, ContainerReport, PublishedDevice};
use super::manifests::CLAIM_REF;

/// The node a pod is bound to.
pub fn pod_node(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
}

/// The name of the claim the pod's template claim [`CLAIM_REF`] generated.
pub fn generated_claim(pod: &Pod) -> Result<String> {
    pod.status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .into_iter()
        .flatten()
        .find(|s| s.name == CLAIM_REF)
        .and_then(|s| s.resource_claim_name.clone())
        .with_context(|| format!("pod {:?} records no generated claim", pod.metadata.name))
}

/// Checks the claim-level env and device nodes kerf's CDI spec gives a container of `claim`
/// whose one device is `gpu`.
pub fn claim_devices(
    report: &ContainerReport,
    claim: &ResourceClaim,
    gpu: &PublishedDevice,
) -> Result<()> {
    report.expect_env("NVIDIA_VISIBLE_DEVICES", "void")?;
    report.expect_env(
        "KERF_CLAIM_UID",
        claim.metadata.uid.as_deref().unwrap_or_default(),
    )?;
    report.expect_env(
        "KERF_CLAIM_NAME",
        claim.metadata.name.as_deref().unwrap_or_default(),
    )?;
    report.expect_env(
        "KERF_CLAIM_NAMESPACE",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
    )?;
    report.expect_env("KERF_DEVICES", &gpu.name)?;
    report.expect_env("KERF_DEVICE_UUIDS", &gpu.uuid)?;
    let minor = gpu
        .minor
        .with_context(|| format!("published device {} has no minor attribute", gpu.name))?;
    let expected = format!("/dev/nvidia{minor}");
    ensure!(
        report.gpu_nodes() == [expected.as_str()],
        "the container should see exactly its GPU's node {expected}; it sees {:?}",
        report.device_nodes
    );
    ensure!(
        report.device_nodes.contains("/dev/nvidiactl"),
        "the container lacks /dev/nvidiactl; it sees {:?}",
        report.device_nodes
    );
    Ok(())
}

/// The one allocation result of kerf's driver on `claim`, as (pool, device), for the suite's
/// request [`CLAIM_REF`].
pub fn single_result(claim: &ResourceClaim, driver: &str) -> Result<(String, String)> {
    single_result_for(claim, driver, CLAIM_REF)
}

/// The one allocation result of kerf's driver on `claim`, as (pool, device), which must be
/// for the request named `request`.
pub fn single_result_for(
    claim: &ResourceClaim,
    driver: &str,
    request: &str,
) -> Result<(String, String)> {
    let results = checks::allocation_results(claim, driver);
    match results.as_slice() {
        [result] => {
            ensure!(
                result.request == request,
                "the result is for request {:?}, expected {request:?}",
                result.request
            );
            Ok((result.pool.clone(), result.device.clone()))
        }
        _ => bail!(
            "expected one allocation result of {driver}, got {}: {}",
            results.len(),
            checks::describe_claim(claim)
        ),
    }
}

/// Fails unless kerf's controller (not kube-scheduler) allocated `claim`, and returns the node.
pub fn controller_node(claim: &ResourceClaim) -> Result<String> {
    ensure!(
        checks::has_allocation_finalizer(claim),
        "the claim lacks kerf's finalizer {}: {}",
        checks::ALLOCATION_FINALIZER,
        checks::describe_claim(claim)
    );
    let node = checks::allocated_node(claim).with_context(|| {
        format!(
            "the claim lacks kerf's annotation {}: {}",
            checks::ALLOCATED_NODE_ANNOTATION,
            checks::describe_claim(claim)
        )
    })?;
    Ok(node.to_owned())
}

/// Fails if kerf's controller marked `claim` (its finalizer or node annotation): a
/// Scheduler-class claim is kube-scheduler's alone.
pub fn left_to_the_scheduler(claim: &ResourceClaim) -> Result<()> {
    ensure!(
        !checks::has_allocation_finalizer(claim) && checks::allocated_node(claim).is_none(),
        "a Scheduler-class claim must be left to kube-scheduler, but kerf's controller marked it: {}",
        checks::describe_claim(claim)
    );
    Ok(())
}

/// The claim's node label (`gpu.kerf.dev/node`), which kerf-controller keeps on every claim
/// allocated with kerf devices for the kubelet plugins' claim caches.
pub fn node_label(claim: &ResourceClaim) -> Option<&str> {
    claim
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(kerf_api::claim_node_label::CLAIM_NODE_LABEL))
        .map(String::as_str)
}

/// Whether nobody holds `claim` any more: no allocation and no `reservedFor` entry.
pub fn is_released(claim: &ResourceClaim) -> bool {
    let reserved = claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .is_some_and(|r| !r.is_empty());
    !checks::is_allocated(claim) && !reserved
}

/// Fails unless `claim`'s allocation config (kerf's controller's `GpuSliceAllocation`) holds
/// exactly one slice, of `memory_bytes` and `compute` percent of `gpu`.
pub fn one_slice(
    claim: &ResourceClaim,
    driver: &str,
    gpu: &PublishedDevice,
    memory_bytes: u64,
    compute: u8,
) -> Result<()> {
    let slice = checks::slice_allocation(claim, driver)?;
    match slice.devices.as_slice() {
        [d] => ensure!(
            d.pool == gpu.node
                && d.device == gpu.name
                && d.gpu_uuid == gpu.uuid
                && d.memory_bytes == Some(memory_bytes)
                && d.compute_percent == Some(compute),
            "the allocation's slice {d:?} is not {memory_bytes} bytes / {compute}% of {}/{} ({})",
            gpu.node,
            gpu.name,
            gpu.uuid
        ),
        other => bail!("expected one slice in the allocation, got {other:?}"),
    }
    Ok(())
}

/// Fails unless kube-scheduler allocated `claim` the whole GPU `gpu`: kerf's controller did
/// not mark the claim, it has no slice config, and `gpu` is a whole GPU.
pub fn whole_by_scheduler(
    claim: &ResourceClaim,
    driver: &str,
    gpu: &PublishedDevice,
) -> Result<()> {
    left_to_the_scheduler(claim)?;
    ensure!(
        gpu.kind == "gpu",
        "{} is a {:?}, not a whole GPU",
        gpu.name,
        gpu.kind
    );
    ensure!(
        checks::slice_allocation(claim, driver).is_err(),
        "a whole GPU of kube-scheduler carries a slice config: {}",
        checks::describe_claim(claim)
    );
    Ok(())
}

/// Fails unless `gpu` is published as `owner`'s (its `allocator` attribute).
pub fn owned_by(gpu: &PublishedDevice, owner: Owner) -> Result<()> {
    ensure!(
        gpu.owner.as_deref() == Some(owner.as_str()),
        "{}/{} is published with allocator {:?}, not {:?}",
        gpu.node,
        gpu.name,
        gpu.owner,
        owner.as_str()
    );
    Ok(())
}
