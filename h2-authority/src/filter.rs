//! The sans-IO core: one direction of an HTTP/2 connection, client to server, read frame by
//! frame. Header blocks are held until complete and handed to a [`BlockRewriter`]; every
//! other byte is released as it arrives.

use bytes::BytesMut;

use crate::frames::{
    self, CONTINUATION, END_HEADERS, END_STREAM, FrameHeader, HEADER_LEN, HEADERS, PREFACE,
    PRIORITY_LEN,
};

/// The most bytes of one header block held back. A larger block is passed on untouched:
/// h2 refuses header lists over 16 KiB by default (`max_header_list_size`), so such a block
/// fails the same way with or without the adapter, and the adapter's memory stays bounded.
pub(crate) const MAX_HELD_BLOCK: usize = 1 << 20;

/// What a [`BlockRewriter`] made of one complete header block.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Rewritten {
    /// Pass the block on as received.
    Unchanged,
    /// Send this header block fragment instead.
    Replaced(Vec<u8>),
    /// The block could not be decoded: pass it on as received and stop looking at this
    /// connection, whose HPACK state is now unknown (the server will refuse it).
    Undecodable,
}

/// Decides about each complete header block of a connection, in order.
pub(crate) trait BlockRewriter {
    /// Called once per header block with its fragments joined (padding and priority fields
    /// removed).
    fn rewrite(&mut self, block: &[u8]) -> Rewritten;
}

/// Where the filter is in the byte stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Position {
    /// Within the connection preface, this many bytes of it seen.
    Preface(usize),
    /// At a frame boundary.
    FrameStart,
    /// Within the payload of a frame that passes untouched, this many bytes of it to go.
    Payload(usize),
    /// The stream is not HTTP/2 as the filter understands it: everything passes untouched.
    Transparent,
}

/// A header block whose END_HEADERS has not been seen yet.
#[derive(Debug, Default)]
struct OpenBlock {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; PRIORITY_LEN]>,
    /// The frames as received, to release untouched when the block is kept.
    raw: BytesMut,
    /// The fragments joined.
    fragment: Vec<u8>,
}

/// One direction (client to server) of an HTTP/2 connection.
pub(crate) struct Filter<R> {
    position: Position,
    open: Option<OpenBlock>,
    rewriter: R,
}

impl<R: BlockRewriter> Filter<R> {
    /// A filter for a connection whose first bytes are the client preface.
    pub(crate) fn new(rewriter: R) -> Self {
        Filter {
            position: Position::Preface(0),
            open: None,
            rewriter,
        }
    }

    /// The rewriter, for inspection.
    #[cfg(test)]
    pub(crate) fn rewriter(&self) -> &R {
        &self.rewriter
    }

    /// Moves from `input` to `output` every byte that can be released now. Bytes of a frame
    /// that must be seen whole stay in `input` until more arrive.
    pub(crate) fn process(&mut self, input: &mut BytesMut, output: &mut BytesMut) {
        loop {
            match self.position {
                Position::Transparent => {
                    release(input, input.len(), output);
                    return;
                }
                Position::Preface(seen) => {
                    let n = input.len().min(PREFACE.len() - seen);
                    if n == 0 {
                        return;
                    }
                    self.position = if input[..n] != PREFACE[seen..seen + n] {
                        Position::Transparent
                    } else if seen + n == PREFACE.len() {
                        Position::FrameStart
                    } else {
                        Position::Preface(seen + n)
                    };
                    release(input, n, output);
                }
                Position::Payload(left) => {
                    let n = input.len().min(left);
                    if n == 0 {
                        return;
                    }
                    release(input, n, output);
                    self.position = if n == left {
                        Position::FrameStart
                    } else {
                        Position::Payload(left - n)
                    };
                }
                Position::FrameStart => {
                    let Some(bytes) = input.get(..HEADER_LEN) else {
                        return;
                    };
                    let Ok(bytes) = <&[u8; HEADER_LEN]>::try_from(bytes) else {
                        return;
                    };
                    let header = FrameHeader::parse(bytes);
                    if !self.next_frame(header, input, output) {
                        return;
                    }
                }
            }
        }
    }

    /// The input ended: what is held is released as received.
    pub(crate) fn finish(&mut self, input: &mut BytesMut, output: &mut BytesMut) {
        self.give_up(output);
        release(input, input.len(), output);
    }

    /// Handles the frame starting at `input`; `false` when it needs more bytes first.
    fn next_frame(
        &mut self,
        header: FrameHeader,
        input: &mut BytesMut,
        output: &mut BytesMut,
    ) -> bool {
        let starts_block = header.kind == HEADERS && self.open.is_none();
        let continues_block = header.kind == CONTINUATION
            && self
                .open
                .as_ref()
                .is_some_and(|open| open.stream_id == header.stream_id);
        if !starts_block && !continues_block {
            if self.open.is_some() {
                // RFC 9113 §6.10: nothing but the block's CONTINUATION may come between its
                // frames. The server refuses the connection; let it see what it was sent.
                self.give_up(output);
                return true;
            }
            release(input, HEADER_LEN, output);
            self.position = if header.len == 0 {
                Position::FrameStart
            } else {
                Position::Payload(header.len)
            };
            return true;
        }
        let held = self.open.as_ref().map_or(0, |open| open.raw.len());
        if held + HEADER_LEN + header.len > MAX_HELD_BLOCK {
            self.give_up(output);
            return true;
        }
        if input.len() < HEADER_LEN + header.len {
            return false;
        }
        let frame = input.split_to(HEADER_LEN + header.len);
        if starts_block {
            self.start_block(header, frame, output);
        } else {
            self.continue_block(header, frame, output);
        }
        true
    }

    fn start_block(&mut self, header: FrameHeader, frame: BytesMut, output: &mut BytesMut) {
        let Some(payload) = frames::headers_payload(header.flags, &frame[HEADER_LEN..]) else {
            release_all(frame, output);
            self.position = Position::Transparent;
            return;
        };
        let open = OpenBlock {
            stream_id: header.stream_id,
            end_stream: header.flags & END_STREAM != 0,
            priority: payload.priority,
            fragment: payload.fragment.to_vec(),
            raw: frame,
        };
        self.open = Some(open);
        if header.flags & END_HEADERS != 0 {
            self.close_block(output);
        }
    }

    fn continue_block(&mut self, header: FrameHeader, frame: BytesMut, output: &mut BytesMut) {
        if let Some(open) = self.open.as_mut() {
            open.fragment.extend_from_slice(&frame[HEADER_LEN..]);
            open.raw.unsplit(frame);
        }
        if header.flags & END_HEADERS != 0 {
            self.close_block(output);
        }
    }

    fn close_block(&mut self, output: &mut BytesMut) {
        let Some(open) = self.open.take() else {
            return;
        };
        match self.rewriter.rewrite(&open.fragment) {
            Rewritten::Unchanged => release_all(open.raw, output),
            Rewritten::Replaced(block) => frames::write_header_block(
                open.stream_id,
                open.end_stream,
                open.priority,
                &block,
                output,
            ),
            Rewritten::Undecodable => {
                release_all(open.raw, output);
                self.position = Position::Transparent;
            }
        }
        if self.position != Position::Transparent {
            self.position = Position::FrameStart;
        }
    }

    /// Releases a partly held block as received and stops filtering.
    fn give_up(&mut self, output: &mut BytesMut) {
        if let Some(open) = self.open.take() {
            release_all(open.raw, output);
        }
        self.position = Position::Transparent;
    }
}

fn release(input: &mut BytesMut, n: usize, output: &mut BytesMut) {
    release_all(input.split_to(n), output);
}

/// Appends `bytes` to `output`; without a copy when they follow each other in one buffer.
fn release_all(bytes: BytesMut, output: &mut BytesMut) {
    if output.is_empty() {
        *output = bytes;
    } else {
        output.unsplit(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Upper-cases every block and records what it saw.
    #[derive(Default)]
    struct Upper {
        seen: Vec<Vec<u8>>,
    }

    impl BlockRewriter for Upper {
        fn rewrite(&mut self, block: &[u8]) -> Rewritten {
            self.seen.push(block.to_vec());
            if block == b"keep" {
                Rewritten::Unchanged
            } else if block == b"junk" {
                Rewritten::Undecodable
            } else {
                Rewritten::Replaced(block.to_ascii_uppercase())
            }
        }
    }

    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        FrameHeader {
            len: payload.len(),
            kind,
            flags,
            stream_id,
        }
        .write(&mut out);
        out.extend_from_slice(payload);
        out.to_vec()
    }

    /// Feeds `input` in pieces of `chunk` bytes, then ends the stream.
    fn run(input: &[u8], chunk: usize) -> (Vec<u8>, Vec<Vec<u8>>) {
        let mut filter = Filter::new(Upper::default());
        let mut pending = BytesMut::new();
        let mut output = BytesMut::new();
        let mut released = Vec::new();
        for piece in input.chunks(chunk) {
            pending.extend_from_slice(piece);
            filter.process(&mut pending, &mut output);
            released.extend_from_slice(&output.split());
        }
        filter.finish(&mut pending, &mut output);
        released.extend_from_slice(&output);
        (released, filter.rewriter().seen.clone())
    }

    fn stream(frames: &[Vec<u8>]) -> Vec<u8> {
        let mut all = PREFACE.to_vec();
        for f in frames {
            all.extend_from_slice(f);
        }
        all
    }

    #[test]
    fn other_frames_pass_and_blocks_are_rewritten_whatever_the_chunking() {
        let settings = frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]);
        let headers = frame(HEADERS, END_HEADERS, 1, b"abc");
        let data = frame(0x0, END_STREAM, 1, &[9; 40]);
        let input = stream(&[settings.clone(), headers, data.clone()]);
        let expected = stream(&[settings, frame(HEADERS, END_HEADERS, 1, b"ABC"), data]);
        for chunk in [1, 2, 7, 9, 10, 64, 4096] {
            let (out, seen) = run(&input, chunk);
            assert_eq!(out, expected, "chunk {chunk}");
            assert_eq!(seen, vec![b"abc".to_vec()]);
        }
    }

    #[test]
    fn continuations_are_joined_and_a_kept_block_passes_byte_for_byte() {
        let input = stream(&[
            frame(HEADERS, END_STREAM, 3, b"ke"),
            frame(CONTINUATION, 0, 3, b""),
            frame(CONTINUATION, END_HEADERS, 3, b"ep"),
        ]);
        let (out, seen) = run(&input, 5);
        assert_eq!(out, input);
        assert_eq!(seen, vec![b"keep".to_vec()]);
    }

    #[test]
    fn padding_is_dropped_and_priority_kept_when_rewritten() {
        let payload = [3, 0, 0, 0, 1, 16, b'x', b'y', 0, 0, 0];
        let input = stream(&[frame(
            HEADERS,
            END_HEADERS | frames::PADDED | frames::PRIORITY,
            5,
            &payload,
        )]);
        let expected = stream(&[frame(
            HEADERS,
            END_HEADERS | frames::PRIORITY,
            5,
            &[0, 0, 0, 1, 16, b'X', b'Y'],
        )]);
        assert_eq!(run(&input, 3).0, expected);
    }

    #[test]
    fn an_interleaved_frame_ends_filtering_and_everything_passes() {
        let input = stream(&[
            frame(HEADERS, 0, 1, b"ab"),
            frame(0x0, 0, 1, b"data"),
            frame(HEADERS, END_HEADERS, 3, b"cd"),
        ]);
        let (out, seen) = run(&input, 4);
        assert_eq!(out, input);
        assert!(seen.is_empty());
    }

    #[test]
    fn an_undecodable_block_ends_filtering() {
        let input = stream(&[
            frame(HEADERS, END_HEADERS, 1, b"junk"),
            frame(HEADERS, END_HEADERS, 3, b"later"),
        ]);
        let (out, seen) = run(&input, 100);
        assert_eq!(out, input);
        assert_eq!(seen, vec![b"junk".to_vec()]);
    }

    #[test]
    fn no_preface_means_no_filtering() {
        let mut input = b"GET / HTTP/1.1\r\n\r\n".to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, b"abc"));
        let (out, seen) = run(&input, 3);
        assert_eq!(out, input);
        assert!(seen.is_empty());
    }

    #[test]
    fn a_truncated_stream_releases_what_it_held() {
        let full = stream(&[frame(HEADERS, 0, 1, b"abc")]);
        let cut = &full[..full.len() - 1];
        assert_eq!(run(cut, 4).0, cut);
        assert_eq!(run(&full, 4).0, full);
    }

    #[test]
    fn an_oversized_block_passes_untouched() {
        let big = vec![b'a'; MAX_HELD_BLOCK];
        let input = stream(&[frame(HEADERS, END_HEADERS, 1, &big)]);
        let (out, seen) = run(&input, 60_000);
        assert_eq!(out, input);
        assert!(seen.is_empty());
    }
}
