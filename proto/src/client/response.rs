//! The plugin's answers to the batched DRA calls, checked by the kubelet's rules.

use std::collections::HashMap;

use super::{Claim, ClientError};
use crate::device::PreparedDevice;
use crate::dra::{v1, v1beta1};

/// The kubelet's view of one claim's prepare answer: its devices, or the plugin's error
/// (the devices of a claim with an error are ignored).
pub type ClaimResult = Result<Vec<PreparedDevice>, String>;

/// The plugin's answer to one batched `NodePrepareResources` call, checked by the kubelet's
/// rules: exactly one entry per requested claim. It holds the decoded message as it came
/// (a v1beta1 answer is lifted into v1's, which only adds `share_id`), so a caller that
/// only looks at it copies nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareResponse {
    claims: HashMap<String, v1::NodePrepareResourceResponse>,
}

impl PrepareResponse {
    /// Checks a v1 answer to `request`.
    pub(super) fn checked_v1(
        request: &[Claim],
        response: v1::NodePrepareResourcesResponse,
    ) -> Result<Self, ClientError> {
        require_every_claim(request, &response.claims)?;
        Ok(PrepareResponse {
            claims: response.claims,
        })
    }

    /// Checks a v1beta1 answer to `request`.
    pub(super) fn checked_v1beta1(
        request: &[Claim],
        response: v1beta1::NodePrepareResourcesResponse,
    ) -> Result<Self, ClientError> {
        require_every_claim(request, &response.claims)?;
        let claims = response
            .claims
            .into_iter()
            .map(|(uid, answer)| {
                let devices = answer.devices.into_iter();
                let answer = v1::NodePrepareResourceResponse {
                    devices: devices.map(|d| PreparedDevice::from(d).into()).collect(),
                    error: answer.error,
                };
                (uid, answer)
            })
            .collect();
        Ok(PrepareResponse { claims })
    }

    /// Number of claims answered (as many as were requested).
    pub fn len(&self) -> usize {
        self.claims.len()
    }

    /// Whether no claim was requested.
    pub fn is_empty(&self) -> bool {
        self.claims.is_empty()
    }

    /// Per claim UID, the number of devices prepared or the plugin's error, without copying
    /// anything.
    pub fn outcomes(&self) -> impl Iterator<Item = (&str, Result<usize, &str>)> {
        self.claims.iter().map(|(uid, answer)| {
            let outcome = if answer.error.is_empty() {
                Ok(answer.devices.len())
            } else {
                Err(answer.error.as_str())
            };
            (uid.as_str(), outcome)
        })
    }

    /// Per claim UID, its devices or its error, as the kubelet records them.
    pub fn into_results(self) -> HashMap<String, ClaimResult> {
        self.claims
            .into_iter()
            .map(|(uid, answer)| (uid, claim_result(answer)))
            .collect()
    }

    /// Per claim UID, its devices, when every claim was prepared: the kubelet fails a pod
    /// whose claims are not all prepared.
    ///
    /// # Errors
    /// [`ClientError::ClaimFailed`] for a claim the plugin answered with an error.
    pub fn all_prepared(self) -> Result<HashMap<String, Vec<PreparedDevice>>, ClientError> {
        self.claims
            .into_iter()
            .map(|(uid, answer)| match claim_result(answer) {
                Ok(devices) => Ok((uid, devices)),
                Err(error) => Err(ClientError::ClaimFailed { uid, error }),
            })
            .collect()
    }
}

/// A per-claim error makes the kubelet ignore the devices.
fn claim_result(answer: v1::NodePrepareResourceResponse) -> ClaimResult {
    if answer.error.is_empty() {
        Ok(answer
            .devices
            .into_iter()
            .map(PreparedDevice::from)
            .collect())
    } else {
        Err(answer.error)
    }
}

/// The plugin's answer to one batched `NodeUnprepareResources` call, checked by the
/// kubelet's rules: exactly one entry per requested claim.
#[derive(Debug, Clone, PartialEq)]
pub struct UnprepareResponse {
    /// Per claim UID, the plugin's error (empty: unprepared). v1 and v1beta1 answer alike.
    errors: HashMap<String, String>,
}

impl UnprepareResponse {
    /// Checks a v1 answer to `request`.
    pub(super) fn checked_v1(
        request: &[Claim],
        response: v1::NodeUnprepareResourcesResponse,
    ) -> Result<Self, ClientError> {
        Self::checked(request, response.claims, |answer| answer.error)
    }

    /// Checks a v1beta1 answer to `request`.
    pub(super) fn checked_v1beta1(
        request: &[Claim],
        response: v1beta1::NodeUnprepareResourcesResponse,
    ) -> Result<Self, ClientError> {
        Self::checked(request, response.claims, |answer| answer.error)
    }

    /// Checks the per-claim `answers` to `request`, keeping each one's error.
    fn checked<T>(
        request: &[Claim],
        answers: HashMap<String, T>,
        error: fn(T) -> String,
    ) -> Result<Self, ClientError> {
        require_every_claim(request, &answers)?;
        let errors = answers.into_iter().map(|(uid, r)| (uid, error(r)));
        Ok(UnprepareResponse {
            errors: errors.collect(),
        })
    }

    /// Number of claims answered (as many as were requested).
    pub fn len(&self) -> usize {
        self.errors.len()
    }

    /// Whether no claim was requested.
    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    /// Per claim UID, `Ok` or the plugin's error, without copying anything.
    pub fn outcomes(&self) -> impl Iterator<Item = (&str, Result<(), &str>)> {
        self.errors
            .iter()
            .map(|(uid, error)| (uid.as_str(), unit_result(error.as_str())))
    }

    /// Per claim UID, `Ok` or the plugin's error.
    pub fn into_results(self) -> HashMap<String, Result<(), String>> {
        self.errors
            .into_iter()
            .map(|(uid, error)| {
                let result = if error.is_empty() { Ok(()) } else { Err(error) };
                (uid, result)
            })
            .collect()
    }

    /// `Ok` when every claim was unprepared.
    ///
    /// # Errors
    /// [`ClientError::ClaimFailed`] for a claim the plugin answered with an error.
    pub fn all_unprepared(&self) -> Result<(), ClientError> {
        self.outcomes().try_for_each(|(uid, outcome)| {
            outcome.map_err(|error| ClientError::ClaimFailed {
                uid: uid.to_owned(),
                error: error.to_owned(),
            })
        })
    }
}

fn unit_result(error: &str) -> Result<(), &str> {
    if error.is_empty() { Ok(()) } else { Err(error) }
}

/// The kubelet refuses a response without an entry for a claim it asked about, or with an
/// entry for one it did not ask about.
pub(super) fn require_every_claim<T>(
    request: &[Claim],
    answers: &HashMap<String, T>,
) -> Result<(), ClientError> {
    if let Some(missing) = request.iter().find(|c| !answers.contains_key(&c.uid)) {
        return Err(ClientError::MissingClaim(missing.uid.clone()));
    }
    // The kubelet looks every entry up in the request, as here.
    match answers
        .keys()
        .find(|uid| !request.iter().any(|c| &c.uid == *uid))
    {
        Some(unknown) => Err(ClientError::UnknownClaim(unknown.clone())),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> [Claim; 2] {
        [Claim::new("ns", "a", "1"), Claim::new("ns", "b", "2")]
    }

    #[test]
    fn a_missing_claim_is_an_error() {
        let answers = HashMap::from([("1".to_owned(), "ok")]);
        assert!(
            matches!(require_every_claim(&claims(), &answers), Err(ClientError::MissingClaim(uid)) if uid == "2")
        );
        let none: HashMap<String, &str> = HashMap::new();
        assert!(matches!(
            require_every_claim(&claims()[..1], &none),
            Err(ClientError::MissingClaim(_))
        ));
    }

    #[test]
    fn an_unrequested_claim_is_an_error() {
        let answers = HashMap::from([("1".to_owned(), "ok"), ("3".to_owned(), "ok")]);
        assert!(
            matches!(require_every_claim(&claims()[..1], &answers), Err(ClientError::UnknownClaim(uid)) if uid == "3")
        );
    }

    #[test]
    fn every_claim_answered_once_is_fine() {
        let answers = HashMap::from([("1".to_owned(), "ok"), ("2".to_owned(), "ok")]);
        assert!(require_every_claim(&claims(), &answers).is_ok());
    }

    fn v1beta1_answer(error: &str) -> v1beta1::NodePrepareResourceResponse {
        v1beta1::NodePrepareResourceResponse {
            devices: vec![v1beta1::Device {
                request_names: vec!["gpu".into()],
                pool_name: "node-1".into(),
                device_name: "gpu-0".into(),
                cdi_device_ids: vec!["k8s.gpu.kerf.dev/gpu=1-gpu-0".into()],
            }],
            error: error.into(),
        }
    }

    #[test]
    fn a_claim_error_voids_its_devices_and_fails_the_pod() {
        let response = v1beta1::NodePrepareResourcesResponse {
            claims: HashMap::from([
                ("1".to_owned(), v1beta1_answer("")),
                ("2".to_owned(), v1beta1_answer("no such GPU")),
            ]),
        };
        let checked = PrepareResponse::checked_v1beta1(&claims(), response).unwrap();
        let mut outcomes: Vec<_> = checked.outcomes().collect();
        outcomes.sort_unstable();
        assert_eq!(outcomes, [("1", Ok(1)), ("2", Err("no such GPU"))]);
        let results = checked.clone().into_results();
        assert_eq!(results["1"].as_ref().unwrap()[0].share_id, None);
        assert_eq!(results["2"], Err("no such GPU".to_owned()));
        assert!(matches!(
            checked.all_prepared(),
            Err(ClientError::ClaimFailed { uid, error }) if uid == "2" && error == "no such GPU"
        ));
    }

    #[test]
    fn unprepare_errors_are_per_claim() {
        let response = v1::NodeUnprepareResourcesResponse {
            claims: HashMap::from([
                ("1".to_owned(), v1::NodeUnprepareResourceResponse::default()),
                (
                    "2".to_owned(),
                    v1::NodeUnprepareResourceResponse {
                        error: "busy".into(),
                    },
                ),
            ]),
        };
        let checked = UnprepareResponse::checked_v1(&claims(), response).unwrap();
        assert!(matches!(
            checked.all_unprepared(),
            Err(ClientError::ClaimFailed { uid, .. }) if uid == "2"
        ));
        let results = checked.into_results();
        assert_eq!(results["1"], Ok(()));
        assert_eq!(results["2"], Err("busy".to_owned()));
    }
}
