//! WATCH: the change history a resumed watch replays, live broadcast of new changes,
//! initial-events-end bookmarks for streaming lists, and `410 Expired` after compaction or
//! when a watcher falls behind.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use http_body::Frame;
use http_body_util::{BodyExt as _, StreamBody};
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::routing::{ApiRequest, Query, api_version_of};
use super::selectors::Filter;
use super::{ApiError, ApiResult, Broadcast, FakeApi, FakeBody, State};

pub(super) fn event_line(event: &str, object: &Value) -> Bytes {
    let mut line = json!({ "type": event, "object": object }).to_string();
    line.push('\n');
    Bytes::from(line)
}

/// A watch event line around an object already serialized (with its opaque parameters as
/// stored, which a [`Value`] cannot carry).
pub(super) fn object_event_line(event: &str, object: &[u8]) -> Bytes {
    let mut line = format!("{{\"type\":\"{event}\",\"object\":").into_bytes();
    line.extend_from_slice(object);
    line.extend_from_slice(b"}\n");
    Bytes::from(line)
}

fn expired_line(since: u64) -> Bytes {
    let err = ApiError::new(410, format!("too old resource version: {since}"));
    event_line("ERROR", &err.to_status())
}

/// An open watch: the backlog first, then live changes until the deadline, a
/// [`FakeApi::close_watches`], or the fake being dropped.
struct WatchStream {
    pending: VecDeque<Bytes>,
    receiver: broadcast::Receiver<Broadcast>,
    filter: Filter,
    deadline: Option<tokio::time::Instant>,
    done: bool,
}

impl WatchStream {
    async fn next_line(&mut self) -> Option<Bytes> {
        loop {
            if let Some(line) = self.pending.pop_front() {
                return Some(line);
            }
            if self.done {
                return None;
            }
            let received = match self.deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, self.receiver.recv())
                    .await
                    .ok()?,
                None => self.receiver.recv().await,
            };
            match received {
                Ok(Broadcast::Change(change)) => {
                    if let Some(line) = self.filter.render(&change) {
                        self.pending.push_back(line);
                    }
                }
                Ok(Broadcast::CloseWatches) | Err(broadcast::error::RecvError::Closed) => {
                    return None;
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    // Fell too far behind: make the client list again, as the API server does.
                    self.pending.push_back(expired_line(0));
                    self.done = true;
                }
            }
        }
    }
}

fn watch_body(watch: WatchStream) -> FakeBody {
    let stream = futures::stream::unfold(watch, |mut watch| async move {
        let line = watch.next_line().await?;
        Some((Ok::<_, Infallible>(Frame::data(line)), watch))
    });
    StreamBody::new(stream.boxed()).boxed_unsync()
}

impl FakeApi {
    /// Ends every open watch, as an API server restart would; kube-runtime watchers resume.
    pub fn close_watches(&self) {
        // No receivers is fine: there is nothing to close.
        let _ = self.inner.events.send(Broadcast::CloseWatches);
    }

    /// Forgets the change history, so watches resuming from an older resourceVersion get
    /// `410 Expired` and must list again, as after etcd compaction.
    pub fn compact(&self) {
        let mut state = self.state();
        state.history.clear();
        state.compacted_below = state.rv + 1;
    }

    pub(super) fn watch(&self, request: &ApiRequest) -> ApiResult<FakeBody> {
        let filter = Filter::new(&request.parsed, &request.query)?;
        let state = self.state();
        // Subscribing and reading the backlog under one lock means no change is lost or sent
        // twice: every later commit happens after this and goes to the receiver.
        let receiver = self.inner.events.subscribe();
        let kind = state.kind_of(&request.parsed.prefix, &request.parsed.resource);
        let backlog = state.watch_backlog(&filter, &request.query, &kind)?;
        drop(state);
        let timeout = request
            .query
            .get("timeoutSeconds")
            .and_then(|s| s.parse::<u64>().ok());
        let deadline = timeout.map(|s| tokio::time::Instant::now() + Duration::from_secs(s));
        let watch = WatchStream {
            pending: backlog,
            receiver,
            filter,
            deadline,
            done: false,
        };
        Ok(watch_body(watch))
    }
}

impl State {
    /// The events a new watch starts with: the current objects for a watch without a
    /// resourceVersion (or `0`) or with `sendInitialEvents`, else the recorded changes after
    /// the given resourceVersion.
    fn watch_backlog(
        &self,
        filter: &Filter,
        query: &Query,
        kind: &str,
    ) -> ApiResult<VecDeque<Bytes>> {
        let rv = query.get("resourceVersion").unwrap_or("");
        let initial = query.flag("sendInitialEvents");
        let mut backlog = VecDeque::new();
        if initial || rv.is_empty() || rv == "0" {
            for (key, obj) in &self.objects {
                if filter.matches(key, obj) {
                    let object = self.render_object(&key.prefix, &key.resource, obj);
                    backlog.push_back(object_event_line("ADDED", &object));
                }
            }
            if initial && query.flag("allowWatchBookmarks") {
                backlog.push_back(self.initial_events_end(filter, kind));
            }
            return Ok(backlog);
        }
        let since: u64 = rv
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid resourceVersion {rv:?}")))?;
        if since + 1 < self.compacted_below {
            backlog.push_back(expired_line(since));
            return Ok(backlog);
        }
        for change in self.history.iter().filter(|c| c.rv > since) {
            if let Some(line) = filter.render(change) {
                backlog.push_back(line);
            }
        }
        Ok(backlog)
    }

    fn initial_events_end(&self, filter: &Filter, kind: &str) -> Bytes {
        let bookmark = json!({
            "apiVersion": api_version_of(&filter.prefix),
            "kind": kind,
            "metadata": {
                "resourceVersion": self.rv.to_string(),
                "annotations": { "k8s.io/initial-events-end": "true" },
            },
        });
        event_line("BOOKMARK", &bookmark)
    }
}
