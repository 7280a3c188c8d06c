//! The default GpuClasses (`--default-gpu-classes`) against the in-memory API server: created
//! when missing once the GpuClass API is served, with kerf-controller's field manager; an
//! existing (edited) class left untouched; a class the admin deleted not created again; a bad
//! defaults file named with its field.

use std::path::Path;
use std::time::Duration;

use clap::Parser as _;
use kerf_api::params::Allocator;
use kerf_api::{GpuClass, GpuClassSpec};
use kerf_controller::BackoffConfig;
use kerf_controller::args::Args;
use kerf_controller::default_classes::{DefaultClasses, RECORD_CONFIGMAP, Report, ensure};
use kerf_tests::fake_api::{FakeApi, Identity};
use kube::api::ObjectMeta;
use tokio_util::sync::CancellationToken;

const GPU_CLASSES: &str = "/apis/gpu.kerf.dev/v1alpha1/gpuclasses";
const RECORD: &str = "/api/v1/namespaces/kerf-system/configmaps/kerf-default-gpu-classes-created";

/// The chart's default classes, as the controller reads them from its ConfigMap.
fn shipped_defaults() -> DefaultClasses {
    let text = kerf_tests::manifests::default_gpu_classes().unwrap();
    DefaultClasses::parse(Path::new("gpuclasses.yaml"), &text, "kerf-system").unwrap()
}

fn defaults() -> DefaultClasses {
    let mut defaults = shipped_defaults();
    defaults.retry = BackoffConfig {
        base: Duration::from_millis(5),
        max: Duration::from_millis(20),
    };
    defaults
}

async fn run(fake: &FakeApi, defaults: &DefaultClasses) -> Report {
    let stop = CancellationToken::new();
    ensure(
        &fake.client_as(Identity::kerf_controller()),
        defaults,
        "kerf-controller",
        &stop,
    )
    .await
    .unwrap()
}

fn stored(fake: &FakeApi, name: &str) -> Option<GpuClass> {
    fake.get_resource::<GpuClass>(None, name)
}

fn recorded(fake: &FakeApi) -> Vec<String> {
    assert!(RECORD.ends_with(RECORD_CONFIGMAP));
    let record = fake.get(RECORD).expect("record ConfigMap");
    record["data"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect()
}

#[tokio::test]
async fn missing_classes_are_created_once_the_crd_is_established() {
    let fake = FakeApi::new();
    // The CRD is not established yet: the API server answers 404 for the resource.
    fake.fail_next("list", GPU_CLASSES, 404, 3);
    let defaults = defaults();
    let report = run(&fake, &defaults).await;
    assert_eq!(report.created, ["gpu.kerf.dev", "slice.gpu.kerf.dev"]);
    assert_eq!(fake.count("list", GPU_CLASSES), 4);
    for class in &defaults.classes {
        let name = class.metadata.name.as_deref().unwrap();
        assert_eq!(stored(&fake, name).unwrap().spec, class.spec, "{name}");
    }
    let creates: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.verb == "create" && r.path.starts_with(GPU_CLASSES))
        .collect();
    assert_eq!(creates.len(), 2);
    for create in creates {
        assert!(
            create.query.contains("fieldManager=kerf-controller"),
            "{}",
            create.query
        );
    }
    assert_eq!(recorded(&fake), ["gpu.kerf.dev", "slice.gpu.kerf.dev"]);
}

#[tokio::test]
async fn an_existing_edited_class_is_left_untouched() {
    let fake = FakeApi::new();
    let edited = GpuClass {
        metadata: ObjectMeta {
            name: Some("slice.gpu.kerf.dev".to_owned()),
            ..ObjectMeta::default()
        },
        spec: GpuClassSpec {
            allocator: Allocator::Scheduler,
            ..GpuClassSpec::default()
        },
        status: None,
    };
    fake.insert_resource(&edited);
    fake.clear_requests();
    let report = run(&fake, &defaults()).await;
    assert_eq!(report.created, ["gpu.kerf.dev"]);
    assert_eq!(report.existing, ["slice.gpu.kerf.dev"]);
    assert_eq!(
        stored(&fake, "slice.gpu.kerf.dev").unwrap().spec,
        edited.spec
    );
    for verb in ["update", "patch", "delete"] {
        assert_eq!(fake.count(verb, GPU_CLASSES), 0, "{verb}");
    }
    // Found existing counts as created: deleting it later is the admin's decision too.
    assert_eq!(recorded(&fake), ["gpu.kerf.dev", "slice.gpu.kerf.dev"]);
}

#[tokio::test]
async fn a_class_the_admin_deleted_is_not_created_again() {
    let fake = FakeApi::new();
    let defaults = defaults();
    run(&fake, &defaults).await;
    fake.remove(&format!("{GPU_CLASSES}/slice.gpu.kerf.dev"))
        .unwrap();
    let report = run(&fake, &defaults).await;
    assert_eq!(report.created, Vec::<String>::new());
    assert_eq!(report.recorded, ["gpu.kerf.dev", "slice.gpu.kerf.dev"]);
    assert!(stored(&fake, "slice.gpu.kerf.dev").is_none());
    // Without the record (e.g. the admin deleted it to start over) missing defaults come back.
    fake.remove(RECORD).unwrap();
    let report = run(&fake, &defaults).await;
    assert_eq!(report.created, ["slice.gpu.kerf.dev"]);
    assert_eq!(report.existing, ["gpu.kerf.dev"]);
    assert!(stored(&fake, "slice.gpu.kerf.dev").is_some());
}

#[tokio::test]
async fn a_class_the_api_server_refuses_is_reported_and_the_rest_created() {
    let fake = FakeApi::new();
    fake.fail_next("create", GPU_CLASSES, 422, 1);
    let report = run(&fake, &defaults()).await;
    assert_eq!(report.rejected, ["gpu.kerf.dev"]);
    assert_eq!(report.created, ["slice.gpu.kerf.dev"]);
    // Not recorded: the next leadership term tries it again.
    assert_eq!(recorded(&fake), ["slice.gpu.kerf.dev"]);
}

#[tokio::test]
async fn waiting_for_the_crd_ends_when_stopped() {
    let fake = FakeApi::new();
    fake.fail_next("list", GPU_CLASSES, 404, usize::MAX);
    let stop = CancellationToken::new();
    stop.cancel();
    let report = ensure(
        &fake.client_as(Identity::kerf_controller()),
        &defaults(),
        "kerf-controller",
        &stop,
    )
    .await
    .unwrap();
    assert_eq!(report, Report::default());
    assert_eq!(fake.count("create", GPU_CLASSES), 0);
}

#[test]
fn a_bad_defaults_file_is_an_error_naming_the_file_and_field() {
    let path =
        std::env::temp_dir().join(format!("kerf-default-classes-{}.yaml", std::process::id()));
    std::fs::write(
        &path,
        "apiVersion: gpu.kerf.dev/v1alpha1\nkind: GpuClass\nmetadata:\n  name: a\nspec:\n  allocator: Sometimes\n",
    )
    .unwrap();
    let args = Args::try_parse_from([
        "kerf-controller",
        "--default-gpu-classes",
        path.to_str().unwrap(),
    ])
    .unwrap();
    let error = args.default_classes().unwrap_err().to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(error.contains("--default-gpu-classes"), "{error}");
    assert!(error.contains(path.to_str().unwrap()), "{error}");
    assert!(error.contains("document 1.spec.allocator"), "{error}");
    assert!(error.contains("Sometimes"), "{error}");

    let missing = Args::try_parse_from([
        "kerf-controller",
        "--default-gpu-classes",
        "/nonexistent/x.yaml",
    ])
    .unwrap()
    .default_classes()
    .unwrap_err()
    .to_string();
    assert!(missing.contains("/nonexistent/x.yaml"), "{missing}");

    let none = Args::try_parse_from(["kerf-controller"]).unwrap();
    assert!(none.default_classes().unwrap().is_none());
}
