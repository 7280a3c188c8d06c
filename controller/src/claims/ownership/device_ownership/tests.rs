use super::*;

const SETTLE: Duration = Duration::from_secs(10);
const LINGER: Duration = Duration::from_secs(30);

fn timing() -> OwnershipTiming {
    OwnershipTiming {
        settle: SETTLE,
        linger: LINGER,
    }
}

fn idle(published: Option<Owner>) -> DeviceFacts {
    DeviceFacts {
        mig: false,
        published,
        recorded: None,
        held_by_controller: false,
        held_by_scheduler: false,
        demanded: false,
    }
}

fn tick(book: &mut DeviceOwnership, facts: &DeviceFacts, now: Instant) -> Option<Change> {
    book.advance(
        "n",
        "gpu-0",
        facts,
        NodePolicy::Dynamic,
        false,
        timing(),
        now,
    )
}

#[test]
fn a_new_idle_device_becomes_usable_only_after_the_republished_slice_and_the_settle_period() {
    let mut book = DeviceOwnership::default();
    let t0 = Instant::now();
    assert_eq!(tick(&mut book, &idle(None), t0), None);
    assert_eq!(book.record("n").owner("gpu-0"), Some(Owner::Controller));
    assert!(!book.usable("n", "gpu-0"), "not published yet");
    let published = idle(Some(Owner::Controller));
    assert_eq!(tick(&mut book, &published, t0 + SETTLE), None);
    assert!(!book.usable("n", "gpu-0"), "observed, settling");
    let epoch = book.epoch("n");
    assert_eq!(
        tick(&mut book, &published, t0 + SETTLE * 2),
        Some(Change::Usable)
    );
    assert!(book.usable("n", "gpu-0"));
    assert_ne!(book.epoch("n"), epoch);
}

#[test]
fn demand_lends_an_idle_device_at_once_and_a_busy_one_never() {
    let mut book = DeviceOwnership::default();
    let t0 = Instant::now();
    let published = idle(Some(Owner::Controller));
    tick(&mut book, &published, t0);
    tick(&mut book, &published, t0 + SETTLE);
    assert!(book.usable("n", "gpu-0"));
    let busy = DeviceFacts {
        held_by_controller: true,
        demanded: true,
        ..published.clone()
    };
    assert_eq!(tick(&mut book, &busy, t0 + SETTLE), None);
    assert!(book.usable("n", "gpu-0"), "a busy device never moves");
    let demanded = DeviceFacts {
        demanded: true,
        ..published
    };
    assert_eq!(
        tick(&mut book, &demanded, t0 + SETTLE),
        Some(Change::Moved {
            to: Owner::Scheduler
        })
    );
    assert!(!book.usable("n", "gpu-0"), "lending is immediate");
    assert_eq!(book.record("n").owner("gpu-0"), Some(Owner::Scheduler));
}

#[test]
fn an_idle_scheduler_device_returns_after_lingering_or_at_once_when_the_controller_waits() {
    let t0 = Instant::now();
    let lent = DeviceFacts {
        recorded: Some(Owner::Scheduler),
        ..idle(Some(Owner::Scheduler))
    };
    let mut book = DeviceOwnership::default();
    tick(&mut book, &lent, t0);
    assert_eq!(book.record("n").owner("gpu-0"), Some(Owner::Scheduler));
    assert_eq!(tick(&mut book, &lent, t0 + LINGER / 2), None);
    assert_eq!(
        tick(&mut book, &lent, t0 + LINGER),
        Some(Change::Moved {
            to: Owner::Controller
        })
    );

    let mut book = DeviceOwnership::default();
    tick(&mut book, &lent, t0);
    let change = book.advance("n", "gpu-0", &lent, NodePolicy::Dynamic, true, timing(), t0);
    assert_eq!(
        change,
        Some(Change::Moved {
            to: Owner::Controller
        })
    );
}

#[test]
fn a_scheduler_allocation_during_the_fence_abandons_the_move() {
    let t0 = Instant::now();
    let mut book = DeviceOwnership::default();
    tick(&mut book, &idle(Some(Owner::Controller)), t0);
    let late = DeviceFacts {
        held_by_scheduler: true,
        ..idle(Some(Owner::Controller))
    };
    assert_eq!(
        tick(&mut book, &late, t0 + SETTLE / 2),
        Some(Change::ReclaimAbandoned)
    );
    assert_eq!(book.record("n").owner("gpu-0"), Some(Owner::Scheduler));
    assert!(!book.usable("n", "gpu-0"));
}

#[test]
fn a_scheduler_allocation_after_the_fence_is_reported() {
    let t0 = Instant::now();
    let mut book = DeviceOwnership::default();
    let published = idle(Some(Owner::Controller));
    tick(&mut book, &published, t0);
    tick(&mut book, &published, t0 + SETTLE);
    let taken = DeviceFacts {
        held_by_scheduler: true,
        ..published
    };
    assert_eq!(
        tick(&mut book, &taken, t0 + SETTLE * 2),
        Some(Change::SchedulerTookControllerDevice)
    );
    assert!(!book.usable("n", "gpu-0"));
}

#[test]
fn mig_devices_and_pinned_nodes_keep_their_owner() {
    let t0 = Instant::now();
    let mut book = DeviceOwnership::default();
    let mig = DeviceFacts {
        mig: true,
        ..idle(None)
    };
    tick(&mut book, &mig, t0 + LINGER * 4);
    assert_eq!(book.record("n").owner("gpu-0"), Some(Owner::Scheduler));

    let mut book = DeviceOwnership::default();
    let pinned = NodePolicy::Fixed(Owner::Scheduler);
    let facts = idle(Some(Owner::Scheduler));
    book.advance("n", "gpu-0", &facts, pinned, true, timing(), t0);
    book.advance(
        "n",
        "gpu-0",
        &facts,
        pinned,
        true,
        timing(),
        t0 + LINGER * 2,
    );
    assert_eq!(book.record("n").owner("gpu-0"), Some(Owner::Scheduler));
}

#[test]
fn devices_held_at_start_up_keep_their_holder_as_owner() {
    let t0 = Instant::now();
    let mut book = DeviceOwnership::default();
    let scheduler_held = DeviceFacts {
        held_by_scheduler: true,
        recorded: Some(Owner::Controller),
        ..idle(Some(Owner::Controller))
    };
    tick(&mut book, &scheduler_held, t0);
    assert_eq!(book.record("n").owner("gpu-0"), Some(Owner::Scheduler));
}

#[test]
fn the_next_due_moment_is_the_settle_fence_then_the_linger_and_never_one_already_past() {
    let mut book = DeviceOwnership::default();
    let t0 = Instant::now();
    let published = idle(Some(Owner::Controller));
    tick(&mut book, &idle(None), t0);
    assert_eq!(
        book.next_due(timing(), t0),
        None,
        "waiting for the republished slice is waiting for an input, not for time"
    );
    tick(&mut book, &published, t0);
    assert_eq!(book.next_due(timing(), t0), Some(t0 + SETTLE));
    assert_eq!(
        tick(&mut book, &published, t0 + SETTLE),
        Some(Change::Usable)
    );
    assert_eq!(
        book.next_due(timing(), t0 + SETTLE),
        None,
        "a usable device moves only on an input"
    );
    let demanded = DeviceFacts {
        demanded: true,
        ..published.clone()
    };
    let lent_at = t0 + SETTLE * 2;
    tick(&mut book, &demanded, lent_at);
    assert_eq!(book.next_due(timing(), lent_at), Some(t0 + LINGER));
    assert_eq!(
        tick(&mut book, &published, t0 + LINGER),
        Some(Change::Moved {
            to: Owner::Controller
        }),
        "the linger counts from when the device went idle"
    );
    assert_eq!(
        book.next_due(timing(), t0 + LINGER),
        Some(t0 + LINGER + SETTLE)
    );
    tick(&mut book, &demanded, t0 + LINGER);
    assert_eq!(
        book.next_due(timing(), t0 + LINGER * 2),
        None,
        "a linger already past while demand keeps the device is not due again"
    );
}
