//! The server side: a stream that hands the HTTP/2 server every client byte, with each
//! `:authority` h2 would refuse replaced.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf as _, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::authority::{AuthorityLog, Lenient};
use crate::filter::Filter;
use crate::rewrite::{AuthorityRewriter, Encoding};

/// How much is read from the socket at a time.
const READ_CHUNK: usize = 16 * 1024;

/// An accepted connection whose client-to-server bytes pass through the authority filter;
/// server-to-client bytes and everything else pass to `S` untouched.
pub struct LenientAuthority<S> {
    inner: S,
    filter: Filter<AuthorityRewriter<Lenient>>,
    /// Bytes read from the socket and not yet released by the filter.
    received: BytesMut,
    /// Bytes released by the filter and not yet read by the server.
    ready: BytesMut,
    eof: bool,
}

impl<S> LenientAuthority<S> {
    /// Wraps an accepted connection; `log` is shared by all connections of one socket.
    pub fn new(inner: S, log: Arc<AuthorityLog>) -> Self {
        LenientAuthority {
            inner,
            filter: Filter::new(AuthorityRewriter::new(
                Lenient { log },
                Encoding::LazyWithoutIndexing,
            )),
            received: BytesMut::new(),
            ready: BytesMut::new(),
            eof: false,
        }
    }

    /// The wrapped connection.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for LenientAuthority<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.ready.is_empty() {
                let n = this.ready.len().min(buf.remaining());
                buf.put_slice(&this.ready[..n]);
                this.ready.advance(n);
                if this.ready.is_empty() {
                    // Let go of the read buffer it was split from, so that the next read
                    // reuses that allocation instead of reserving a new one.
                    this.ready = BytesMut::new();
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            this.received.reserve(READ_CHUNK);
            let n = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut this.inner),
                cx,
                &mut this.received
            ))?;
            if n == 0 {
                this.eof = true;
                this.filter.finish(&mut this.received, &mut this.ready);
            } else {
                this.filter.process(&mut this.received, &mut this.ready);
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for LenientAuthority<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for LenientAuthority<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}
