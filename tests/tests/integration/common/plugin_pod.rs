//! The kubelet plugin's own pod, as the DaemonSet of `deploy/kerf.yaml` (the mock overlay)
//! creates it on a node: what `--mps-daemons=pod` reads at start-up and copies into the MPS
//! control daemon pods (image, program, security context, hostPath mounts).

use k8s_openapi::api::core::v1::Pod;
use kerf_tests::fake_api::KERF_NAMESPACE;
use serde_json::{Value, json};

/// The plugin pod's name (`--pod-name`, `POD_NAME`).
pub const PLUGIN_POD: &str = "kerf-kubelet-plugin-x7k2p";
/// The plugin's program in its image (the chart's DaemonSet), which the pod
/// runner maps to the `kerf-test-plugin` binary.
pub const IMAGE_PROGRAM: &str = "/usr/local/bin/kerf-kubelet-plugin";

/// The plugin's pod [`PLUGIN_POD`] in kerf-system, bound to `node`, with the spec and labels
/// of the DaemonSet's template in `deploy/kerf-mock.yaml` (its image included).
pub fn plugin_pod_from_manifest(node: &str) -> Pod {
    plugin_pod_from(kerf_tests::manifests::MOCK_INSTALL, node)
}

/// As [`plugin_pod_from_manifest`], from the text of such a manifest.
pub fn plugin_pod_from(manifest: &str, node: &str) -> Pod {
    let documents: Vec<Value> = serde_saphyr::from_multiple(manifest).unwrap();
    let daemon_set = documents
        .into_iter()
        .find(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == "kerf-kubelet-plugin")
        .unwrap();
    let template = &daemon_set["spec"]["template"];
    let mut spec = template["spec"].clone();
    spec["nodeName"] = json!(node);
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": PLUGIN_POD,
            "namespace": KERF_NAMESPACE,
            "labels": template["metadata"]["labels"],
        },
        "spec": spec,
    }))
    .unwrap()
}
