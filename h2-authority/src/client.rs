//! The client side: a stream under an HTTP/2 client that makes every request carry a chosen
//! `:authority`, including values the client's own stack cannot put in a URI (a socket
//! path, a percent-encoded path, an empty value) or none at all. With it a Rust client
//! speaks to a plugin exactly as the kubelet's grpc-go clients do.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf as _, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::authority::SendAuthority;
use crate::filter::Filter;
use crate::rewrite::{AuthorityRewriter, Encoding};

/// A client connection whose requests carry the `:authority` it was made with. The header
/// blocks the client writes are re-encoded as grpc-go's encoder would write them (literals
/// with incremental indexing, Huffman-coded), so a second request on a connection refers
/// to the first one's `:authority` by dynamic index, as the kubelet's do. Everything the
/// server sends passes untouched.
pub struct WithAuthority<S> {
    inner: S,
    filter: Filter<AuthorityRewriter<SendAuthority>>,
    /// Bytes written by the client and not yet released by the filter.
    written: BytesMut,
    /// Bytes released by the filter and not yet written to `inner`.
    pending: BytesMut,
}

impl<S> WithAuthority<S> {
    /// Wraps a connection that a client is about to start HTTP/2 on.
    pub fn new(inner: S, authority: SendAuthority) -> Self {
        WithAuthority {
            inner,
            filter: Filter::new(AuthorityRewriter::new(authority, Encoding::AlwaysIndexing)),
            written: BytesMut::new(),
            pending: BytesMut::new(),
        }
    }
}

impl<S: AsyncWrite + Unpin> WithAuthority<S> {
    /// Writes out what the filter released.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.pending.is_empty() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.pending.advance(n);
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WithAuthority<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WithAuthority<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        this.written.extend_from_slice(buf);
        this.filter.process(&mut this.written, &mut this.pending);
        // What cannot be written now goes out with the next write or flush.
        if let Poll::Ready(Err(e)) = this.poll_drain(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.filter.finish(&mut this.written, &mut this.pending);
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}
