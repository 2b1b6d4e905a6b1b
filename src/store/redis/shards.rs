//! The uncertain index's shards (lib.lua): which shard a permit's open
//! attempts are indexed in, and which shards a cross-permit walk reads.
//!
//! A script may only touch keys of one Cluster slot, and every key of a
//! permit shares the hash tag `{permit_id}`. So a permit's shard is a key
//! whose hash tag `{T}` lands in the permit's own slot, and Authorize,
//! Commit and MarkUncertain keep the index in the same atomic step as the
//! attempt. A walk reads every shard: outside a Cluster one (tag "0",
//! every permit's), on a Cluster the 64 slots that permits are placed in
//! (every 256th: a permit id is drawn until it lands in one,
//! [`Shards::place`]).

use std::sync::LazyLock;

/// Redis Cluster's number of slots.
const SLOTS: u16 = 16384;

/// On a Cluster, new permits are placed in every `SPACING`th slot: 64
/// shards, spread over the slot space as Cluster spreads slots over nodes.
const SPACING: u16 = 256;

/// What Cluster hashes of `key`: its hash tag (between the first `{` and
/// the next `}`, if not empty), or the whole key.
pub(super) fn hash_tag(key: &[u8]) -> &[u8] {
    key.iter()
        .position(|b| *b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|b| *b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key)
}

/// The Cluster slot of `key` (CRC16 of its hash tag).
pub(super) fn slot(key: &[u8]) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(hash_tag(key)) % SLOTS
}

/// A hash tag in every slot: `TAGS[s]` (a short hex number) hashes to
/// slot `s`. About 170 000 numbers tried, once, in milliseconds.
static TAGS: LazyLock<Vec<String>> = LazyLock::new(|| {
    let mut tags = vec![String::new(); usize::from(SLOTS)];
    let mut missing = usize::from(SLOTS);
    let mut n: u64 = 0;
    while missing > 0 {
        let tag = format!("{n:x}");
        let s = usize::from(slot(tag.as_bytes()));
        if tags[s].is_empty() {
            tags[s] = tag;
            missing -= 1;
        }
        n += 1;
    }
    tags
});

/// Where a store's uncertain index lives.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shards {
    cluster: bool,
}

impl Shards {
    /// On a Cluster, the tags are made here, at start-up, not by the first
    /// request.
    pub(super) fn new(cluster: bool) -> Self {
        if cluster {
            LazyLock::force(&TAGS);
        }
        Self { cluster }
    }

    /// The hash tag of `permit_id`'s shard.
    pub(super) fn tag(self, permit_id: &str) -> &'static str {
        if self.cluster {
            &TAGS[usize::from(slot(permit_id.as_bytes()))]
        } else {
            "0"
        }
    }

    /// Whether a permit with this id is indexed in one of [`Self::placed`]:
    /// on a Cluster, whether its slot is one of theirs.
    pub(super) fn place(self, permit_id: &str) -> bool {
        !self.cluster || slot(permit_id.as_bytes()).is_multiple_of(SPACING)
    }

    /// The tags of the shards every new permit is indexed in.
    pub(super) fn placed(self) -> Vec<&'static str> {
        if self.cluster {
            (0..SLOTS)
                .step_by(usize::from(SPACING))
                .map(|s| TAGS[usize::from(s)].as_str())
                .collect()
        } else {
            vec!["0"]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{SLOTS, Shards, TAGS, slot};

    /// The slot is Cluster's own, as redis-rs routes it.
    #[test]
    fn slots_are_clusters() {
        use redis::cluster_routing::Slot;
        for key in [
            "p:{0190-abc}:permit",
            "p:permits:tenant-a",
            "{x}",
            "a{}b",
            "{",
        ] {
            assert_eq!(
                Slot::new(slot(key.as_bytes())),
                Some(Slot::for_key(key)),
                "{key}"
            );
        }
    }

    #[test]
    fn every_slot_has_a_tag_in_it() {
        assert_eq!(TAGS.len(), usize::from(SLOTS));
        for (s, tag) in TAGS.iter().enumerate() {
            assert_eq!(usize::from(slot(tag.as_bytes())), s, "{tag}");
        }
    }

    /// A permit's shard is in the permit's slot; a placed id's shard is
    /// one of the placed ones.
    #[test]
    fn a_permits_shard_is_in_its_slot() {
        let cluster = Shards::new(true);
        let placed = cluster.placed();
        assert_eq!(placed.len(), 64);
        let mut placed_ids = 0;
        for n in 0..4096u128 {
            let id = uuid::Uuid::from_u128(n * 0x9e37_79b9_7f4a_7c15).to_string();
            let tag = cluster.tag(&id);
            assert_eq!(
                slot(format!("p:uncertain:{{{tag}}}").as_bytes()),
                slot(format!("p:{{{id}}}:permit").as_bytes())
            );
            if cluster.place(&id) {
                placed_ids += 1;
                assert!(placed.contains(&tag));
            } else {
                assert!(!placed.contains(&tag));
            }
        }
        assert!((4..=40).contains(&placed_ids), "{placed_ids}");
        let one = Shards::new(false);
        assert_eq!(one.placed(), vec!["0"]);
        assert!(one.place("anything"));
        assert_eq!(one.tag("x"), "0");
    }
}
