//! gRPC on Unix sockets whatever `:authority` the client sends.
//!
//! # Why this crate exists
//!
//! The kubelet's plugin watcher dials a plugin's registration socket with
//! `grpc.DialContext(ctx, <socket path>, WithContextDialer(...))` and no `WithAuthority`
//! (kubernetes `pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`,
//! `dial`), so grpc-go sends the HTTP/2 pseudo-header `:authority` = the socket path.
//! Python grpcio since 1.57 sends the percent-encoded path for `unix:` targets
//! (grpc/grpc#38142), old grpc-go an empty one (grpc/grpc-go#2628). h2, under hyper and
//! tonic, parses `:authority` as a URI authority (`http::uri::Authority`, in
//! `server::Peer::convert_poll_message`) and resets the stream with PROTOCOL_ERROR when
//! that fails, before tonic sees the request; it has no option to relax this. The Go gRPC
//! servers the kubelet is built against take `:authority` as opaque metadata
//! (grpc-go `internal/transport/http2_server.go`, `operateHeaders`), so every plugin
//! written in Go registers, and a Rust one does not.
//!
//! # What it does
//!
//! [`LenientAuthority`] sits between an accepted connection and the HTTP/2 server. It
//! reads the client's bytes frame by frame. Each header block (a HEADERS frame and its
//! CONTINUATION frames) is held until complete and decoded with the connection's HPACK
//! state; every other frame passes as it arrives. A block whose `:authority` h2 accepts,
//! or that has none, passes byte for byte. A block with any other `:authority` — the
//! socket path, a percent-encoded path, an empty value — is re-encoded with
//! `:authority: localhost`, the value grpc-go sends for `unix:` targets.
//!
//! # What it guarantees
//!
//! - Server-to-client bytes pass untouched, and so do client-to-server bytes until the
//!   first header block that needs a change: a connection from a client that sends
//!   `localhost` (the kubelet's DRA client) is byte-for-byte what it was without the adapter.
//! - From the first changed block on, every header block of the connection is re-encoded:
//!   the first one starts with a dynamic table size update to zero, and all use literals
//!   that are never added to the dynamic table. The server's HPACK table is then empty and
//!   stays empty, so it can never disagree with the client's: the adapter resolves the
//!   client's references to its own table itself, with its own decoder.
//! - The header list is the same — names, values, order — but for `:authority`. Stream
//!   identifiers, END_STREAM and priority fields are kept; padding is dropped; a block is
//!   split into frames of at most 16 KiB, which every peer accepts.
//! - What the adapter cannot read — a connection without the HTTP/2 preface, a frame
//!   between a block's HEADERS and CONTINUATION frames, an HPACK error, a header block over
//!   1 MiB — is passed on as received from then on, so the server refuses it as it would
//!   without the adapter.
//! - Each [`AuthorityForm`] a socket sees is logged once, at info ([`AuthorityLog`]);
//!   nothing is logged per request.
//!
//! # What it costs
//!
//! About 1 µs per request on the pass-through path, measured against the same h2
//! conversation without the adapter in `benches/adapter.rs`; the header blocks are decoded
//! into one reused buffer by the crate's own HPACK decoder (see `hpack.rs` for why not a
//! decoder crate), so a block that passes unchanged allocates only for entries the client
//! adds to its dynamic table.
//!
//! [`WithAuthority`] is the mirror image for clients: it makes every request of an HTTP/2
//! client carry a chosen `:authority` (or none), re-encoding header blocks as grpc-go's
//! encoder writes them, so tests and tools can speak exactly as the kubelet does.

mod authority;
mod client;
mod filter;
mod frames;
mod hpack;
mod rewrite;
mod server;

pub use authority::{AuthorityForm, AuthorityLog, SendAuthority};
pub use client::WithAuthority;
pub use server::LenientAuthority;
