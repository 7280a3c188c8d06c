//! The checkpoint's record of a dynamically created MIG instance decodes tolerantly: an
//! intent without ids, a record from a newer plugin with fields this build does not know, and
//! a record missing fields all decode.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests may fail loudly.

use kerf_core::checkpoint::{MigInstanceRecord, RecordedPlacement};
use kerf_core::inventory::MigPlacement;
use serde_json::json;

fn intent() -> MigInstanceRecord {
    MigInstanceRecord {
        parent_uuid: "GPU-1".into(),
        parent_minor: 3,
        profile: "1g.5gb".into(),
        gi_profile_id: 19,
        ci_profile_id: 0,
        placement: RecordedPlacement { start: 6, size: 1 },
        gi_id: None,
        ci_id: None,
        mig_uuid: None,
    }
}

#[test]
fn an_intent_leaves_the_ids_out_and_a_completed_record_has_them() {
    let value = serde_json::to_value(intent()).unwrap();
    assert_eq!(
        value,
        json!({"parentUuid": "GPU-1", "parentMinor": 3, "profile": "1g.5gb", "giProfileId": 19,
               "ciProfileId": 0, "placement": {"start": 6, "size": 1}})
    );
    let done = MigInstanceRecord {
        gi_id: Some(13),
        ci_id: Some(0),
        mig_uuid: Some("MIG-x".into()),
        ..intent()
    };
    let text = serde_json::to_string(&done).unwrap();
    assert_eq!(
        serde_json::from_str::<MigInstanceRecord>(&text).unwrap(),
        done
    );
}

#[test]
fn unknown_and_missing_fields_are_tolerated() {
    let newer = json!({"parentUuid": "GPU-1", "parentMinor": 3, "profile": "1g.5gb",
        "giProfileId": 19, "ciProfileId": 0, "placement": {"start": 6, "size": 1, "depth": 2},
        "giId": 13, "future": {"x": 1}});
    let record: MigInstanceRecord = serde_json::from_value(newer).unwrap();
    assert_eq!(record.gi_id, Some(13));
    assert_eq!(
        MigPlacement::from(record.placement),
        MigPlacement { start: 6, size: 1 }
    );
    let sparse: MigInstanceRecord = serde_json::from_value(json!({"parentMinor": 1})).unwrap();
    assert_eq!(sparse.parent_minor, 1);
    assert_eq!(sparse.gi_id, None);
    assert_eq!(sparse.placement, RecordedPlacement::default());
}
