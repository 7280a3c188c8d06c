//! kerf's GpuQuota custom resource in FakeApi: a `status` subresource as a CRD declares it
//! (kubernetes/kubernetes `staging/src/k8s.io/apiextensions-apiserver/pkg/registry/customresource/`:
//! `strategy.go` drops the status on create and keeps it on updates of the main resource,
//! `status_strategy.go` keeps all but the status on `/status` writes), and stale writes refused.

use crate::fake_api_webhooks::fixture;

use fixture::{api_error, gpu_quota, gpu_quotas};
use kerf_tests::fake_api::FakeApi;
use kube::api::PostParams;
use serde_json::json;

#[tokio::test]
async fn gpu_quotas_have_a_status_subresource_and_refuse_stale_writes() {
    let fake = FakeApi::new();
    let quotas = gpu_quotas(&fake);
    let created = quotas
        .create(
            &PostParams::default(),
            &gpu_quota(json!({"hard": {"gpus": 2}}), json!({"used": {"gpus": 9}})),
        )
        .await
        .unwrap();
    // Created without the status a client sent, as a CRD with the subresource is.
    assert!(created.data.get("status").is_none());
    let mut status_write = created.clone();
    status_write.data["spec"] = json!({"hard": {"gpus": 99}});
    status_write.data["status"] = json!({"used": {"gpus": 1}});
    let after_status = quotas
        .replace_status("team-a", &PostParams::default(), &status_write)
        .await
        .unwrap();
    assert_eq!(after_status.data["spec"], json!({"hard": {"gpus": 2}}));
    assert_eq!(after_status.data["status"], json!({"used": {"gpus": 1}}));
    let mut main_write = after_status.clone();
    main_write.data["spec"] = json!({"hard": {"gpus": 3}});
    main_write.data["status"] = json!({"used": {"gpus": 7}});
    let after_main = quotas
        .replace("team-a", &PostParams::default(), &main_write)
        .await
        .unwrap();
    assert_eq!(after_main.data["spec"], json!({"hard": {"gpus": 3}}));
    assert_eq!(after_main.data["status"], json!({"used": {"gpus": 1}}));
    // `status_write` carries the first resourceVersion: both subresources refuse it.
    let stale = api_error(
        quotas
            .replace_status("team-a", &PostParams::default(), &status_write)
            .await,
    );
    assert_eq!((stale.code, stale.reason.as_str()), (409, "Conflict"));
    let stale = api_error(
        quotas
            .replace("team-a", &PostParams::default(), &status_write)
            .await,
    );
    assert_eq!((stale.code, stale.reason.as_str()), (409, "Conflict"));
    assert_eq!(
        stale.message,
        "Operation cannot be fulfilled on gpuquotas.gpu.kerf.dev \"team-a\": the object has been modified; please apply your changes to the latest version and try again"
    );
}
