//! What the allocator reads from a pod's claims, worked out once per Filter instead of once
//! per node: each request's class, CEL expressions and parsed `capacity.requests`, and each
//! claim's constraints, fresh.
//!
//! Upstream's `Allocate` (`allocator_incubating.go`) walks the claims on every node, but
//! nothing it reads from them depends on the node; only the devices a request's selectors
//! accept do ([`crate::Allocator`]'s candidates). The walk's outcome on a node is kept
//! exactly: where it stops at a claim (an unsupported request or constraint: the cycle
//! fails; a missing class: the node does not fit), the requests before that point still
//! get their candidates on each node first, so a CEL error of an earlier request is the
//! error reported, as before.

use k8s_openapi::api::resource::v1::{DeviceClass, ExactDeviceRequest, ResourceClaim};

use crate::capacity::Requested;
use crate::constraints::Constraint;
use crate::pods::claim_key;
use crate::snapshot::Snapshot;

/// One request of one claim, as every node's attempt reads it.
pub(crate) struct PlannedRequest<'a> {
    /// The claim's position among the claims allocated together.
    pub claim: usize,
    pub name: &'a str,
    pub exactly: &'a ExactDeviceRequest,
    pub requested: Requested<'a>,
    pub class: &'a DeviceClass,
    /// The class's CEL selectors, then the request's.
    pub expressions: Vec<&'a str>,
    /// `allocationMode: All`.
    pub all: bool,
    pub count: usize,
}

/// Where every node's walk over the claims stops.
pub(crate) enum Halt {
    /// An unsupported request or constraint: the cycle is aborted with this message.
    Error(String),
    /// A request's DeviceClass does not exist: no node fits.
    NoClass,
}

/// The claims' requests and constraints (see the module documentation).
pub(crate) struct Plan<'a> {
    /// The requests the walk gets to, in claim and request order.
    pub requests: Vec<PlannedRequest<'a>>,
    /// Each claim's constraints with nothing added yet.
    pub constraints: Vec<Vec<Constraint<'a>>>,
    /// Where the walk stops after `requests`, if it does.
    pub halt: Option<Halt>,
}

impl<'a> Plan<'a> {
    /// The plan of `claims` against the classes of `snapshot`.
    pub(crate) fn new(snapshot: &'a Snapshot, claims: &[&'a ResourceClaim]) -> Self {
        let mut plan = Plan {
            requests: Vec::new(),
            constraints: Vec::new(),
            halt: None,
        };
        for (index, claim) in claims.iter().enumerate() {
            if let Err(halt) = plan.add_claim(snapshot, index, claim) {
                plan.halt = Some(halt);
                break;
            }
        }
        plan
    }

    /// Adds one claim's constraints and requests, or says where the walk stops.
    fn add_claim(
        &mut self,
        snapshot: &'a Snapshot,
        index: usize,
        claim: &'a ResourceClaim,
    ) -> Result<(), Halt> {
        let devices = claim.spec.devices.as_ref();
        let constraints = devices
            .iter()
            .flat_map(|d| d.constraints.iter().flatten())
            .enumerate()
            .map(|(i, c)| {
                Constraint::new(c, i)
                    .map_err(|e| Halt::Error(format!("claim {}: {e}", claim_key(claim))))
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.constraints.push(constraints);
        for request in devices.iter().flat_map(|d| d.requests.iter().flatten()) {
            let Some(exactly) = &request.exactly else {
                return Err(Halt::Error(format!(
                    "request {}: only `exactly` is supported",
                    request.name
                )));
            };
            let Some(class) = snapshot.classes.get(&exactly.device_class_name) else {
                return Err(Halt::NoClass);
            };
            let expressions = class
                .spec
                .selectors
                .iter()
                .flatten()
                .chain(exactly.selectors.iter().flatten())
                .filter_map(|s| s.cel.as_ref().map(|c| c.expression.as_str()))
                .collect();
            let wanted = exactly.capacity.as_ref().and_then(|c| c.requests.as_ref());
            self.requests.push(PlannedRequest {
                claim: index,
                name: &request.name,
                exactly,
                requested: Requested::new(wanted),
                class,
                expressions,
                all: exactly.allocation_mode.as_deref() == Some("All"),
                count: usize::try_from(exactly.count.unwrap_or(1)).unwrap_or(0),
            });
        }
        Ok(())
    }
}
