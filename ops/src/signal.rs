//! Shutdown signals.

/// Waits for SIGTERM (what the kubelet sends) or Ctrl-C.
pub async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops the process");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
