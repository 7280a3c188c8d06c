//! Decoding a header block with the connection's HPACK state, applying an [`AuthorityPolicy`]
//! and encoding the result again.

use httlib_hpack::Encoder;

use crate::filter::{BlockRewriter, Rewritten};
use crate::hpack::{Decoder, HeaderList};

/// The pseudo-header the adapters are about.
pub(crate) const AUTHORITY: &[u8] = b":authority";

/// The dynamic table size both ends start with (RFC 9113 §6.5.2, SETTINGS_HEADER_TABLE_SIZE).
/// h2, under hyper and tonic, never announces another one, so a client may not use more.
pub(crate) const DEFAULT_TABLE_SIZE: usize = 4096;

/// What to do with a request's `:authority`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Leave it as it is (or absent).
    Keep,
    /// Send this value (inserted after the other pseudo-headers if there was none).
    Set(Vec<u8>),
    /// Send no `:authority`.
    Remove,
}

/// Decides about the `:authority` of each header block of a connection.
pub(crate) trait AuthorityPolicy {
    /// `authority` is the block's `:authority` value, `None` when it has none.
    fn decide(&mut self, authority: Option<&[u8]>) -> Decision;
}

/// How blocks are encoded once they are re-encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Encoding {
    /// Pass blocks through until the policy first changes one; from then on encode every
    /// block with literals that are never added to the dynamic table, after one dynamic
    /// table size update to zero. The receiver's table is then empty and stays empty, so it
    /// never disagrees with what the sender's encoder (whose table the adapter's decoder
    /// follows) refers to: the adapter resolves those references itself.
    LazyWithoutIndexing,
    /// Encode every block, from the first, as grpc-go's `x/net/http2/hpack` encoder does:
    /// fields found whole in the tables are indexed, every other field is a literal with
    /// incremental indexing (its name indexed when known), strings Huffman-coded.
    AlwaysIndexing,
}

/// A [`BlockRewriter`] for one connection.
pub(crate) struct AuthorityRewriter<P> {
    decoder: Decoder,
    encoder: Encoder<'static>,
    encoding: Encoding,
    /// Whether blocks are re-encoded now (always for [`Encoding::AlwaysIndexing`]).
    reencoding: bool,
    policy: P,
    /// The last block's fields, kept to reuse the allocation.
    fields: HeaderList,
}

impl<P: AuthorityPolicy> AuthorityRewriter<P> {
    /// A rewriter with fresh HPACK state, as at the start of a connection.
    pub(crate) fn new(policy: P, encoding: Encoding) -> Self {
        let encoder_table = match encoding {
            Encoding::LazyWithoutIndexing => 0,
            Encoding::AlwaysIndexing => DEFAULT_TABLE_SIZE,
        };
        AuthorityRewriter {
            decoder: Decoder::new(DEFAULT_TABLE_SIZE),
            encoder: Encoder::with_dynamic_size(u32::try_from(encoder_table).unwrap_or(0)),
            encoding,
            reencoding: encoding == Encoding::AlwaysIndexing,
            policy,
            fields: HeaderList::default(),
        }
    }

    fn encode(
        &mut self,
        fields: Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<Vec<u8>, httlib_hpack::EncoderError> {
        let mut block = Vec::with_capacity(fields.iter().map(|(n, v)| n.len() + v.len() + 2).sum());
        let flags = match self.encoding {
            Encoding::LazyWithoutIndexing => Encoder::BEST_FORMAT,
            Encoding::AlwaysIndexing => {
                Encoder::BEST_FORMAT
                    | Encoder::WITH_INDEXING
                    | Encoder::HUFFMAN_NAME
                    | Encoder::HUFFMAN_VALUE
            }
        };
        for (name, value) in fields {
            self.encoder.encode((name, value, flags), &mut block)?;
        }
        Ok(block)
    }
}

impl<P: AuthorityPolicy> BlockRewriter for AuthorityRewriter<P> {
    fn rewrite(&mut self, block: &[u8]) -> Rewritten {
        if self.decoder.decode(block, &mut self.fields).is_err() {
            return Rewritten::Undecodable;
        }
        let position = self.fields.position(AUTHORITY);
        let decision = self
            .policy
            .decide(position.and_then(|i| self.fields.value(i)));
        if decision == Decision::Keep && !self.reencoding {
            return Rewritten::Unchanged;
        }
        // Only blocks that change are copied out of the reused list.
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = self
            .fields
            .iter()
            .map(|(name, value)| (name.to_vec(), value.to_vec()))
            .collect();
        apply(&mut fields, position, decision);
        let mut prefix = Vec::new();
        if !self.reencoding {
            // The receiver's table still holds what the client indexed; empty it, so that
            // it matches the adapter's encoder (which never indexes) from here on.
            if self
                .encoder
                .update_max_dynamic_size(0, &mut prefix)
                .is_err()
            {
                return Rewritten::Undecodable;
            }
            self.reencoding = true;
        }
        match self.encode(fields) {
            Ok(encoded) if prefix.is_empty() => Rewritten::Replaced(encoded),
            Ok(encoded) => {
                prefix.extend_from_slice(&encoded);
                Rewritten::Replaced(prefix)
            }
            // Only an impossible index or a string over 4 GiB fails; the block cannot be
            // sent in another form, so it passes as received and the server decides.
            Err(_) => Rewritten::Undecodable,
        }
    }
}

/// Applies `decision` to a decoded header list whose `:authority` is at `position`.
fn apply(fields: &mut Vec<(Vec<u8>, Vec<u8>)>, position: Option<usize>, decision: Decision) {
    match (decision, position) {
        (Decision::Keep, _) | (Decision::Remove, None) => {}
        (Decision::Remove, Some(i)) => {
            fields.remove(i);
        }
        (Decision::Set(value), Some(i)) => fields[i].1 = value,
        (Decision::Set(value), None) => {
            // Pseudo-headers precede regular fields (RFC 9113 §8.3).
            let at = fields
                .iter()
                .position(|(name, _)| !name.starts_with(b":"))
                .unwrap_or(fields.len());
            fields.insert(at, (AUTHORITY.to_vec(), value));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Always(Decision);

    impl AuthorityPolicy for Always {
        fn decide(&mut self, _: Option<&[u8]>) -> Decision {
            self.0.clone()
        }
    }

    fn field(name: &str, value: &str) -> (Vec<u8>, Vec<u8>) {
        (name.as_bytes().to_vec(), value.as_bytes().to_vec())
    }

    #[test]
    fn a_missing_authority_is_inserted_after_the_pseudo_headers() {
        let mut fields = vec![
            field(":method", "POST"),
            field(":path", "/x"),
            field("te", "trailers"),
        ];
        apply(&mut fields, None, Decision::Set(b"localhost".to_vec()));
        assert_eq!(fields[2], field(":authority", "localhost"));
        assert_eq!(fields[3], field("te", "trailers"));
    }

    #[test]
    fn remove_and_set_act_in_place() {
        let mut fields = vec![
            field(":method", "POST"),
            field(":authority", "/a.sock"),
            field("te", "trailers"),
        ];
        apply(&mut fields, Some(1), Decision::Set(b"localhost".to_vec()));
        assert_eq!(fields[1], field(":authority", "localhost"));
        apply(&mut fields, Some(1), Decision::Remove);
        assert_eq!(
            fields,
            vec![field(":method", "POST"), field("te", "trailers")]
        );
    }

    #[test]
    fn indexing_encoding_refers_to_what_it_indexed() {
        let mut encoder = loona_hpack::Encoder::new();
        let block = encoder.encode([(&b":authority"[..], &b"localhost"[..])]);
        let mut rewriter = AuthorityRewriter::new(
            Always(Decision::Set(b"/run/x.sock".to_vec())),
            Encoding::AlwaysIndexing,
        );
        let Rewritten::Replaced(first) = rewriter.rewrite(&block) else {
            panic!("expected a rewrite");
        };
        let Rewritten::Replaced(second) = rewriter.rewrite(&block) else {
            panic!("expected a rewrite");
        };
        // First a literal with incremental indexing of static name 1, then dynamic index 62.
        assert_eq!(first[0], 0x40 | 0x01);
        assert_eq!(second, vec![0x80 | 0x3e]);
        let mut server = loona_hpack::Decoder::new();
        for b in [&first, &second] {
            assert_eq!(
                server.decode(b).unwrap(),
                vec![field(":authority", "/run/x.sock")]
            );
        }
    }
}
