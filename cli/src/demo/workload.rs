//! The demo's pods and claims as the API server and kube-controller-manager would make them:
//! a Deployment of N replicas becomes N pods, each template claim of a pod becomes a generated
//! ResourceClaim owned by the pod, and every object gets a UID.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodSpec;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::manifests::Manifests;

/// Namespace of objects that name none, as `kubectl apply` would put them.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Annotation kube-controller-manager puts on a claim generated from a template.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// A pod of the demo.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoPod {
    /// Namespace.
    pub namespace: String,
    /// Name (`<deployment>-<i>` for a Deployment's replicas).
    pub name: String,
    /// Generated UID.
    pub uid: String,
    /// `Deployment/<name>` when a Deployment made it.
    pub owner: Option<String>,
    /// Where it was read.
    pub origin: String,
    /// Its claims, in `spec.resourceClaims` order.
    pub claims: Vec<PodClaim>,
}

/// One entry of a pod's `spec.resourceClaims`, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodClaim {
    /// The name the pod gives the claim.
    pub pod_claim_name: String,
    /// Index into [`Workload::claims`], or why the claim does not exist.
    pub claim: Result<usize, String>,
}

/// A ResourceClaim of the demo, from a manifest or generated from a template.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoClaim {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The claim as stored (UID set), or `None` when its manifest was refused.
    pub claim: Option<ResourceClaim>,
    /// Why the manifest was refused.
    pub manifest_error: Option<String>,
    /// Where it was read (the template's origin for generated claims).
    pub origin: String,
    /// The template it was generated from.
    pub template: Option<String>,
    /// Pods that use it, `namespace/name`.
    pub pods: Vec<String>,
}

impl DemoClaim {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The claim's UID ("" when its manifest was refused).
    pub fn uid(&self) -> &str {
        self.claim
            .as_ref()
            .and_then(|c| c.metadata.uid.as_deref())
            .unwrap_or_default()
    }
}

/// Every pod and claim of the demo.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Workload {
    /// Pods in manifest order (a Deployment's replicas in place of the Deployment).
    pub pods: Vec<DemoPod>,
    /// Claims: first the ResourceClaim manifests (refused ones included), then the generated
    /// ones in pod order.
    pub claims: Vec<DemoClaim>,
}

/// Builds the pods and claims of `manifests`.
pub fn build(manifests: &Manifests) -> Workload {
    let mut workload = Workload::default();
    for parsed in &manifests.claims {
        let mut claim = parsed.object.clone();
        let namespace = namespace_of(&claim.metadata);
        let name = claim.metadata.name.clone().unwrap_or_default();
        claim.metadata.namespace = Some(namespace.clone());
        claim.metadata.uid = Some(uid_for("ResourceClaim", &namespace, &name));
        workload.claims.push(DemoClaim {
            namespace,
            name,
            claim: Some(claim),
            manifest_error: None,
            origin: parsed.origin.clone(),
            template: None,
            pods: Vec::new(),
        });
    }
    for refused in manifests
        .invalid
        .iter()
        .filter(|i| i.kind == "ResourceClaim")
    {
        workload.claims.push(DemoClaim {
            namespace: refused
                .namespace
                .clone()
                .unwrap_or_else(|| DEFAULT_NAMESPACE.to_owned()),
            name: refused.name.clone(),
            claim: None,
            manifest_error: Some(refused.error.clone()),
            origin: refused.origin.clone(),
            template: None,
            pods: Vec::new(),
        });
    }
    let templates: BTreeMap<(String, String), &ResourceClaimTemplate> = manifests
        .templates
        .iter()
        .map(|t| {
            let key = (
                namespace_of(&t.object.metadata),
                t.object.metadata.name.clone().unwrap_or_default(),
            );
            (key, &t.object)
        })
        .collect();
    for (pod_meta, spec, owner, origin) in pod_sources(manifests) {
        let pod = make_pod(&pod_meta, &spec, owner, origin, &templates, &mut workload);
        workload.pods.push(pod);
    }
    workload
}

/// Every pod to create: the Pod manifests and each Deployment's replicas, in manifest order.
fn pod_sources(manifests: &Manifests) -> Vec<(ObjectMeta, PodSpec, Option<String>, String)> {
    let mut sources: Vec<(String, ObjectMeta, PodSpec, Option<String>)> = Vec::new();
    for pod in &manifests.pods {
        let spec = pod.object.spec.clone().unwrap_or_default();
        sources.push((pod.origin.clone(), pod.object.metadata.clone(), spec, None));
    }
    for deployment in &manifests.deployments {
        let object = &deployment.object;
        let name = object.metadata.name.clone().unwrap_or_default();
        let namespace = namespace_of(&object.metadata);
        let Some(spec) = object.spec.as_ref() else {
            continue;
        };
        let template_meta = spec.template.metadata.clone().unwrap_or_default();
        let pod_spec = spec.template.spec.clone().unwrap_or_default();
        let replicas = usize::try_from(spec.replicas.unwrap_or(1)).unwrap_or(0);
        for i in 0..replicas {
            let meta = ObjectMeta {
                name: Some(format!("{name}-{i}")),
                namespace: Some(namespace.clone()),
                labels: template_meta.labels.clone(),
                annotations: template_meta.annotations.clone(),
                ..ObjectMeta::default()
            };
            sources.push((
                deployment.origin.clone(),
                meta,
                pod_spec.clone(),
                Some(format!("Deployment/{name}")),
            ));
        }
    }
    // Origins sort by file and document, which is manifest order.
    sources.sort_by_key(|a| origin_order(&a.0));
    sources
        .into_iter()
        .map(|(origin, meta, spec, owner)| (meta, spec, owner, origin))
        .collect()
}

/// `file#n` as a key that sorts documents numerically within a file.
fn origin_order(origin: &str) -> (String, usize) {
    match origin.rsplit_once('#') {
        Some((file, n)) => (file.to_owned(), n.parse().unwrap_or(0)),
        None => (origin.to_owned(), 0),
    }
}

fn make_pod(
    meta: &ObjectMeta,
    spec: &PodSpec,
    owner: Option<String>,
    origin: String,
    templates: &BTreeMap<(String, String), &ResourceClaimTemplate>,
    workload: &mut Workload,
) -> DemoPod {
    let namespace = namespace_of(meta);
    let name = meta.name.clone().unwrap_or_default();
    let uid = uid_for("Pod", &namespace, &name);
    let pod_key = format!("{namespace}/{name}");
    let mut claims = Vec::new();
    for entry in spec.resource_claims.as_deref().unwrap_or_default() {
        let claim = if let Some(claim_name) = &entry.resource_claim_name {
            find_claim(workload, &namespace, claim_name)
        } else if let Some(template_name) = &entry.resource_claim_template_name {
            let key = (namespace.clone(), template_name.clone());
            match templates.get(&key) {
                Some(template) => {
                    let generated = generated_claim(template, &namespace, &name, &uid, &entry.name);
                    workload.claims.push(DemoClaim {
                        namespace: namespace.clone(),
                        name: generated.metadata.name.clone().unwrap_or_default(),
                        claim: Some(generated),
                        manifest_error: None,
                        origin: origin.clone(),
                        template: Some(template_name.clone()),
                        pods: Vec::new(),
                    });
                    Ok(workload.claims.len() - 1)
                }
                None => Err(format!(
                    "ResourceClaimTemplate {namespace}/{template_name} not found"
                )),
            }
        } else {
            Err(format!(
                "spec.resourceClaims[{:?}] names neither a claim nor a template",
                entry.name
            ))
        };
        if let Ok(index) = claim {
            workload.claims[index].pods.push(pod_key.clone());
        }
        claims.push(PodClaim {
            pod_claim_name: entry.name.clone(),
            claim,
        });
    }
    DemoPod {
        namespace,
        name,
        uid,
        owner,
        origin,
        claims,
    }
}

fn find_claim(workload: &Workload, namespace: &str, name: &str) -> Result<usize, String> {
    let found = workload
        .claims
        .iter()
        .position(|c| c.namespace == namespace && c.name == name);
    match found {
        Some(index) => match &workload.claims[index].manifest_error {
            // The API server refused it, so for the scheduler it does not exist.
            Some(_) => Err(format!(
                "ResourceClaim {namespace}/{name} was not created: its manifest is invalid"
            )),
            None => Ok(index),
        },
        None => Err(format!("ResourceClaim {namespace}/{name} not found")),
    }
}

/// The claim kube-controller-manager creates for a pod's template claim: the template's
/// spec, labels and annotations, the pod as controller owner, and the pod claim name
/// annotation. Named `<pod>-<pod claim name>` (the real one adds a random suffix).
fn generated_claim(
    template: &ResourceClaimTemplate,
    namespace: &str,
    pod: &str,
    pod_uid: &str,
    pod_claim_name: &str,
) -> ResourceClaim {
    let template_meta = template.spec.metadata.clone().unwrap_or_default();
    let name = format!("{pod}-{pod_claim_name}");
    let mut annotations = template_meta.annotations.unwrap_or_default();
    annotations.insert(
        POD_CLAIM_NAME_ANNOTATION.to_owned(),
        pod_claim_name.to_owned(),
    );
    ResourceClaim {
        metadata: ObjectMeta {
            uid: Some(uid_for("ResourceClaim", namespace, &name)),
            name: Some(name),
            namespace: Some(namespace.to_owned()),
            labels: template_meta.labels,
            annotations: Some(annotations),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".to_owned(),
                kind: "Pod".to_owned(),
                name: pod.to_owned(),
                uid: pod_uid.to_owned(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            ..ObjectMeta::default()
        },
        spec: template.spec.spec.clone(),
        status: None,
    }
}

fn namespace_of(meta: &ObjectMeta) -> String {
    meta.namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| DEFAULT_NAMESPACE.to_owned())
}

/// A UID in the API server's format (lowercase UUID), derived from the object's identity so
/// that every run of the demo prints the same IDs.
pub fn uid_for(kind: &str, namespace: &str, name: &str) -> String {
    let key = format!("{kind}/{namespace}/{name}");
    let high = fnv1a(key.as_bytes(), 0xcbf2_9ce4_8422_2325);
    let low = fnv1a(key.as_bytes(), 0x6c62_272e_07bb_0142);
    let bytes: u128 = (u128::from(high) << 64) | u128::from(low);
    // Version 8 ("custom") and the RFC 9562 variant, so it reads as a well-formed UUID.
    let bytes = (bytes & !(0xf << 76) & !(0x3 << 62)) | (0x8 << 76) | (0x2 << 62);
    let hex = format!("{bytes:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

fn fnv1a(bytes: &[u8], basis: u64) -> u64 {
    bytes.iter().fold(basis, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_are_stable_well_formed_and_distinct() {
        let a = uid_for("ResourceClaim", "default", "a");
        assert_eq!(a, uid_for("ResourceClaim", "default", "a"));
        assert_ne!(a, uid_for("ResourceClaim", "default", "b"));
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "8");
        kerf_core::names::claim_uid("uid", &a).unwrap();
    }
}
