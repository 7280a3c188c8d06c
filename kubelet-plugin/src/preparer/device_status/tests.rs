//! Unit tests of the per-device claim status writer.

use super::*;
use kube::core::Status;

fn api_error(code: u16, message: &str) -> Result<bool, kube::Error> {
    Err(kube::Error::Api(
        Status::failure(message, "").with_code(code).boxed(),
    ))
}

#[test]
fn answers_are_classified_as_upstream_gives_them() {
    assert_eq!(classify(&Ok(true)), Outcome::Done("written"));
    assert!(matches!(
        classify(&Ok(false)),
        Outcome::Disable {
            label: "field_dropped",
            ..
        }
    ));
    assert_eq!(
        classify(&api_error(404, "not found")),
        Outcome::Dropped {
            label: "claim_gone",
            warn: false
        }
    );
    assert!(matches!(
        classify(&api_error(403, "forbidden")),
        Outcome::Disable {
            label: "forbidden",
            ..
        }
    ));
    let granular = r#"ResourceClaim.resource.k8s.io "c" is invalid: status.devices: Forbidden: changing status.devices requires resource="resourceclaims/driver", verb="[associated-node:patch arbitrary-node:patch]" permission"#;
    assert!(matches!(
        classify(&api_error(422, granular)),
        Outcome::Disable {
            label: "forbidden",
            ..
        }
    ));
    let deallocated = r#"status.devices[0]: Invalid value: "gpu.kerf.dev/node-1/gpu-0": must be an allocated device in the claim"#;
    assert_eq!(
        classify(&api_error(422, deallocated)),
        Outcome::Dropped {
            label: "deallocated",
            warn: false
        }
    );
    assert_eq!(
        classify(&api_error(422, "status.devices[0].data: Too long")),
        Outcome::Dropped {
            label: "invalid",
            warn: true
        }
    );
    for transient in [409, 429, 500, 503, 504] {
        assert_eq!(
            classify(&api_error(transient, "busy")),
            Outcome::Retry,
            "{transient}"
        );
    }
}
