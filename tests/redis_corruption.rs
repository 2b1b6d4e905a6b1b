//! Every Redis script validates all it reads before its first write, and
//! never reads a default into what it cannot read: for each script, a
//! state in which it would write (or, for the read-only ones, answer), and
//! each value it reads there corrupted in turn, as a hand edit, another
//! version or a bug could leave it: a field missing, a string where a number
//! belongs, a float or "1e3" where an integer belongs, a code this version
//! does not know, an attempt record of another shape or with an element of
//! another type, a set member that names no open attempt, a key of another
//! type. Each answers STORE_UNAVAILABLE and leaves every key of the store
//! byte for byte as it was (DUMP and PEXPIRETIME of each), or, where
//! [`TABLE`] says why, gives the answer it names.
//!
//! [`TABLE`] is the one list of cases; `the_table_lists_every_read` holds
//! it to the scripts' sources, so a script that starts reading a field, an
//! attempt, a set or a key the table does not list fails here.

use crate::support::{Redis, load_library, redis_store, shared};
use atmost::domain::{
    ApprovalRule, ApproveCmd, AuthorizeCmd, CommitCmd, Decision, DenyCmd, DuplicateGuard, Error,
    GetAttemptCmd, GuardMode, MarkUncertainCmd, Millis, Outcome, Permit, PermitStatus, ResolveCmd,
    Scope, UncertainPolicy, new_id,
};
use atmost::store::{INDEX_MARGIN_MS, Store, redis::RedisStore};
use redis::aio::MultiplexedConnection;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

// === the cases ===

/// A state built through the store, and the one call made in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// authorize.lua: a new key "k2" repeating the request of "k1" (open,
    /// RESERVED) under the LOG guard and HOLD_TOOL: it reads the guard's
    /// pointer, k1's record and the tool's held members, and its DISPATCH
    /// writes every key.
    AuthorizeNew,
    /// authorize.lua: k1 released (NotSent) and reserved again: its record
    /// is read, then overwritten.
    AuthorizeReleased,
    /// authorize.lua: k1 UNCERTAIN under HOLD_TOOL; a new key for its tool
    /// reads k1's held member (and k1's record) and is refused.
    AuthorizeHeld,
    /// settle.lua: the holder's NotSent of k1, the one open attempt: the
    /// open count reaches 0 (forget_at, the keys unpinned) and the guard's
    /// pointer goes.
    CommitNotSent,
    /// settle.lua: the holder's Succeeded of k1 while k2 is open too.
    CommitSucceeded,
    /// settle.lua: an operator's Resolve (Failed) of k1, UNCERTAIN.
    ResolveUncertain,
    /// mark_uncertain.lua: k1 RESERVED becomes UNCERTAIN.
    MarkUncertain,
    /// revoke_permit.lua, by an operator, with k1 open.
    Revoke,
    /// close_permit.lua, through the sweep: expired past the index margin,
    /// nothing open (k1 committed); it is closed and leaves the index.
    Close,
    /// create_permit.lua: a permit id not yet used.
    Create,
    /// index_permit.lua, run directly (through the store, create_permit.lua
    /// writes the permit first): the permit enters its tenant's index.
    Index,
    /// index_tenant.lua, run directly (through the store, after
    /// index_permit.lua): the tenant's entry in the tenants index, with a
    /// fresh token, replaces its earlier one.
    IndexTenant,
    /// get_permit.lua (read-only), k1 open.
    GetPermit,
    /// get_attempt.lua (read-only): k1, RESERVED.
    GetAttempt,
    /// list_uncertain.lua (read-only): k1, UNCERTAIN.
    ListUncertain,
    /// census.lua (read-only), through the census: k1, UNCERTAIN.
    Census,
    /// census_turn.lua, through the census with an interval: the fleet's
    /// figures stale (published long before), so this replica takes the
    /// turn, counts k1 (UNCERTAIN) and publishes.
    CensusTurn,
    /// census_publish.lua: the same call, which publishes after counting.
    CensusPublish,
    /// list_index.lua (read-only), through ListUncertain across permits:
    /// k1, UNCERTAIN.
    ListIndex,
    /// uncertain_attempts.lua (read-only): the same call, which reads the
    /// attempts the index named.
    ListAttempts,
    // On a permit whose tool u needs one approval (lib.lua: appr,
    // ap:<tool>), where "k3" (tool u) was requested at SETUP and awaits it
    // ([`Scenario::wait`]: lapsed at OP, or still waiting).
    /// authorize.lua: a new key "k2" (tool t) first writes k3's lapse
    /// (lib.lua: lapse), then dispatches.
    AuthorizeLapse,
    /// authorize.lua: a new key "k4" of tool u waits for approval.
    AuthorizeWaits,
    /// authorize.lua: k3, approved at MARK, claimed by its requester.
    AuthorizeClaim,
    /// settle.lua: k1's Commit (Succeeded) first writes k3's lapse.
    CommitLapse,
    /// mark_uncertain.lua: k1 marked, after k3's lapse is written.
    MarkLapse,
    /// approve.lua: an approver approves k3.
    ApproveWaiting,
    /// deny.lua: an approver denies k3.
    DenyWaiting,
    /// revoke_permit.lua: k3 denied with its permit.
    RevokePending,
    /// get_permit.lua (read-only): k3's slot and cost not held, lapsed.
    GetPermitLapsed,
    /// get_attempt.lua (read-only): k3, waiting.
    GetAttemptWaiting,
    /// list_approvals.lua (read-only): the permit's calls awaiting
    /// approval, k3.
    ListApprovals,
    /// list_index.lua (read-only), through ListApprovals across permits:
    /// the tenant's approvals index.
    ListApprovalsIndex,
    /// awaiting_attempts.lua (read-only): the same call, which reads the
    /// calls the index named.
    ListAwaiting,
    /// close_permit.lua, through the sweep: the permit (k1 committed, k3
    /// lapsed at its expiry) closed, and k3's entry dropped from the
    /// approvals index.
    ClosePending,
}

impl Scenario {
    const ALL: [Scenario; 34] = [
        Scenario::AuthorizeNew,
        Scenario::AuthorizeReleased,
        Scenario::AuthorizeHeld,
        Scenario::CommitNotSent,
        Scenario::CommitSucceeded,
        Scenario::ResolveUncertain,
        Scenario::MarkUncertain,
        Scenario::Revoke,
        Scenario::Close,
        Scenario::Create,
        Scenario::Index,
        Scenario::IndexTenant,
        Scenario::GetPermit,
        Scenario::GetAttempt,
        Scenario::ListUncertain,
        Scenario::Census,
        Scenario::CensusTurn,
        Scenario::CensusPublish,
        Scenario::ListIndex,
        Scenario::ListAttempts,
        Scenario::AuthorizeLapse,
        Scenario::AuthorizeWaits,
        Scenario::AuthorizeClaim,
        Scenario::CommitLapse,
        Scenario::MarkLapse,
        Scenario::ApproveWaiting,
        Scenario::DenyWaiting,
        Scenario::RevokePending,
        Scenario::GetPermitLapsed,
        Scenario::GetAttemptWaiting,
        Scenario::ListApprovals,
        Scenario::ListApprovalsIndex,
        Scenario::ListAwaiting,
        Scenario::ClosePending,
    ];

    /// With the approval rule on tool u: its wait, so that k3 has lapsed
    /// at OP (short) or is still waiting (long; at ClosePending's sweep,
    /// it lapsed with the permit's expiry).
    fn wait(self) -> Option<Millis> {
        use Scenario::*;
        match self {
            AuthorizeLapse | CommitLapse | MarkLapse | GetPermitLapsed => Some(SHORT_WAIT),
            AuthorizeWaits | AuthorizeClaim | ApproveWaiting | DenyWaiting | RevokePending
            | GetAttemptWaiting | ListApprovals | ListApprovalsIndex | ListAwaiting
            | ClosePending => Some(LONG_WAIT),
            _ => None,
        }
    }

    /// The key whose record the Record and Element cases corrupt.
    fn subject(self) -> &'static str {
        if self.wait().is_some() { "k3" } else { "k1" }
    }

    /// The tool whose t:, n: and ap: fields the Field cases corrupt.
    fn tool(self) -> &'static str {
        if self.wait().is_some() { "u" } else { TOOL }
    }

    fn script(self) -> &'static str {
        use Scenario::*;
        match self {
            AuthorizeNew | AuthorizeReleased | AuthorizeHeld => "authorize",
            CommitNotSent | CommitSucceeded | ResolveUncertain => "settle",
            MarkUncertain => "mark_uncertain",
            Revoke => "revoke_permit",
            Close => "close_permit",
            Create => "create_permit",
            Index => "index_permit",
            IndexTenant => "index_tenant",
            GetPermit => "get_permit",
            GetAttempt => "get_attempt",
            ListUncertain => "list_uncertain",
            Census => "census",
            CensusTurn => "census_turn",
            CensusPublish => "census_publish",
            ListIndex => "list_index",
            ListAttempts => "uncertain_attempts",
            AuthorizeLapse | AuthorizeWaits | AuthorizeClaim => "authorize",
            CommitLapse => "settle",
            MarkLapse => "mark_uncertain",
            ApproveWaiting => "approve",
            DenyWaiting => "deny",
            RevokePending => "revoke_permit",
            GetPermitLapsed => "get_permit",
            GetAttemptWaiting => "get_attempt",
            ListApprovals => "list_approvals",
            ListApprovalsIndex => "list_index",
            ListAwaiting => "awaiting_attempts",
            ClosePending => "close_permit",
        }
    }

    /// The answer on the uncorrupted state.
    fn normal(self) -> &'static str {
        use Scenario::*;
        match self {
            AuthorizeNew | AuthorizeReleased | AuthorizeLapse | AuthorizeClaim => "DISPATCH",
            AuthorizeHeld => "TOOL_HELD_UNCERTAIN",
            AuthorizeWaits => "AWAIT_APPROVAL",
            // The permit, then the tenant's entry (its index empty).
            Close | ClosePending => "dropped 2",
            ListUncertain | ListIndex | ListAttempts | ListApprovals | ListApprovalsIndex
            | ListAwaiting => "1 listed",
            Census | CensusTurn | CensusPublish => "1 uncertain",
            _ => "OK",
        }
    }

    /// Whether the call writes on the uncorrupted state.
    fn writes(self) -> bool {
        use Scenario::*;
        !matches!(
            self,
            AuthorizeHeld
                | GetPermit
                | GetAttempt
                | ListUncertain
                | Census
                | ListIndex
                | ListAttempts
                | GetPermitLapsed
                | GetAttemptWaiting
                | ListApprovals
                | ListApprovalsIndex
                | ListAwaiting
        )
    }
}

/// What is corrupted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    /// A field of the permit hash; "t:" and "n:" are tool t's.
    Field(&'static str),
    /// An element of the subject's attempt record ([`Scenario::subject`]:
    /// k1, or k3 with its approval), a cmsgpack array (1-based, as lib.lua's
    /// load_attempt reads it; 16: the approval, and each of its fields;
    /// 17: one more than atmost writes).
    Element(usize),
    /// The subject's record as a whole: not the one cmsgpack array
    /// save_attempt writes.
    Record,
    /// The duplicate guard's pointer for k1's tool and fingerprint.
    DupPointer,
    /// k1's member of the open set, or of the held set.
    OpenMember,
    HeldMember,
    /// A member of the tenant's cross-permit index.
    IndexMember,
    /// A member of the tenants index.
    TenantMember,
    /// A member of the uncertain index (the fleet's shard, or the
    /// tenant's).
    UncertainMember,
    /// k3's member of the pending set, of the awaiting set; a member of
    /// the tenant's approvals index.
    PendingMember,
    AwaitingMember,
    ApprovalsMember,
    /// A field of the fleet's census figures.
    CensusField(&'static str),
    /// The key (lib.lua's names: permit, attempts, open, dup, held,
    /// pending, awaiting, index; uncertain, uncertain_t and approvals_t
    /// for the shards of the cross-permit indexes) replaced by a string.
    KeyType(&'static str),
}

/// The corrupted values of a case.
#[derive(Debug, Clone, Copy)]
enum Vals {
    /// The target's own list ([`values`]).
    Kind,
    /// These values (a field or the guard's pointer).
    Set(&'static [&'static [u8]]),
    /// The field, the pointer or the member removed.
    Delete,
    /// The guard's pointer names a key with no attempt.
    Dangling,
    /// A member of the set's range that is not the shape atmost writes
    /// (the census reads only the first member's shape).
    Shapes,
    /// k1's member replaced by one past the range the script reads.
    OutOfRange,
    /// A member added to the index: another permit's, not one atmost
    /// writes.
    AddMember(&'static str),
    /// The permit's own index member already there, with a score atmost
    /// does not write.
    OwnMember,
}

/// What the call must answer.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// STORE_UNAVAILABLE, every key as it was.
    Unavailable,
    /// This answer, every key as it was.
    Unchanged(&'static str),
    /// This answer, writing what it writes (the value is legitimately not
    /// read on this path, or any value of it is one atmost may write).
    Writes(&'static str),
}

use Expect::{Unavailable, Unchanged, Writes};
use Scenario::*;
use Target::{
    ApprovalsMember, AwaitingMember, CensusField, DupPointer, Element, Field, HeldMember,
    IndexMember, KeyType, OpenMember, PendingMember, Record, TenantMember, UncertainMember,
};

/// Every field of the permit hash (lib.lua's header).
const ALL_FIELDS: [&str; 22] = [
    "subject",
    "currency",
    "tools",
    "exp",
    "lease",
    "gmode",
    "gwin",
    "status",
    "created",
    "budget",
    "upol",
    "t:",
    "n:",
    "committed",
    "reserved",
    "open",
    "fa",
    "closed",
    "ten",
    "agents",
    "appr",
    "ap:",
];

/// Another tenant's permit, or one whose agents do not include the
/// caller's: any value there is one atmost may write, and the permit is
/// not the caller's to see.
const OTHER_TENANT: &[&[u8]] = &[b"globex", b"", b"\xff"];
const OTHER_AGENTS: &[&[u8]] = &[b"a2", b"", b"\xff"];

/// The one table: (scenario, what is corrupted, with what, the answer).
/// Every value a script reads is here, for a scenario of that script.
const TABLE: &[(Scenario, Target, Vals, Expect)] = &[
    // --- authorize.lua
    (AuthorizeNew, Field("exp"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("status"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("lease"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("gmode"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("gwin"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("budget"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("committed"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("reserved"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("t:"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("n:"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("open"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("upol"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("fa"), Vals::Kind, Unavailable),
    (AuthorizeNew, Field("closed"), Vals::Kind, Unavailable),
    (
        AuthorizeNew,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (
        AuthorizeNew,
        Field("ten"),
        Vals::Delete,
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (
        AuthorizeNew,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (AuthorizeNew, Record, Vals::Kind, Unavailable),
    (AuthorizeNew, DupPointer, Vals::Kind, Unavailable),
    (AuthorizeNew, DupPointer, Vals::Dangling, Unavailable),
    // A pointer lost (as by a collision) only loses the guard's hint.
    (AuthorizeNew, DupPointer, Vals::Delete, Writes("DISPATCH")),
    (AuthorizeNew, HeldMember, Vals::Kind, Unavailable),
    // k1's own held member is not uncertain at `now`: not in the range
    // authorize reads, which reads the held set, not the attempts.
    (AuthorizeNew, HeldMember, Vals::Delete, Writes("DISPATCH")),
    (AuthorizeNew, KeyType("permit"), Vals::Kind, Unavailable),
    (AuthorizeNew, KeyType("attempts"), Vals::Kind, Unavailable),
    (AuthorizeNew, KeyType("open"), Vals::Kind, Unavailable),
    (AuthorizeNew, KeyType("dup"), Vals::Kind, Unavailable),
    (AuthorizeNew, KeyType("held"), Vals::Kind, Unavailable),
    (AuthorizeNew, KeyType("uncertain"), Vals::Kind, Unavailable),
    (
        AuthorizeNew,
        KeyType("uncertain_t"),
        Vals::Kind,
        Unavailable,
    ),
    (AuthorizeReleased, Record, Vals::Kind, Unavailable),
    (AuthorizeReleased, DupPointer, Vals::Kind, Unavailable),
    (AuthorizeReleased, KeyType("open"), Vals::Kind, Unavailable),
    (AuthorizeReleased, KeyType("held"), Vals::Kind, Unavailable),
    (AuthorizeHeld, HeldMember, Vals::Kind, Unavailable),
    // No uncertain member: the tool is not held (the held set is what
    // authorize reads).
    (AuthorizeHeld, HeldMember, Vals::Delete, Writes("DISPATCH")),
    (AuthorizeHeld, Record, Vals::Kind, Unavailable),
    (AuthorizeHeld, KeyType("held"), Vals::Kind, Unavailable),
    // Refused before the duplicate guard and the reservation: neither key
    // is read or written on this path.
    (
        AuthorizeHeld,
        KeyType("open"),
        Vals::Kind,
        Unchanged("TOOL_HELD_UNCERTAIN"),
    ),
    (
        AuthorizeHeld,
        KeyType("dup"),
        Vals::Kind,
        Unchanged("TOOL_HELD_UNCERTAIN"),
    ),
    // --- settle.lua
    (CommitNotSent, Field("exp"), Vals::Kind, Unavailable),
    (CommitNotSent, Field("budget"), Vals::Kind, Unavailable),
    (CommitNotSent, Field("committed"), Vals::Kind, Unavailable),
    (CommitNotSent, Field("reserved"), Vals::Kind, Unavailable),
    // Less than k1's cost.
    (
        CommitNotSent,
        Field("reserved"),
        Vals::Set(&[b"0"]),
        Unavailable,
    ),
    (CommitNotSent, Field("open"), Vals::Kind, Unavailable),
    // Not the number of open attempts (the open set's).
    (
        CommitNotSent,
        Field("open"),
        Vals::Set(&[b"0", b"2"]),
        Unavailable,
    ),
    (CommitNotSent, Field("n:"), Vals::Kind, Unavailable),
    (CommitNotSent, Field("n:"), Vals::Delete, Unavailable),
    // Fewer slots than k1 holds.
    (CommitNotSent, Field("n:"), Vals::Set(&[b"0"]), Unavailable),
    (CommitNotSent, Field("t:"), Vals::Kind, Unavailable),
    (CommitNotSent, Field("t:"), Vals::Delete, Unavailable),
    (CommitNotSent, Field("upol"), Vals::Kind, Unavailable),
    (CommitNotSent, Field("fa"), Vals::Kind, Unavailable),
    (
        CommitNotSent,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (
        CommitNotSent,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (CommitNotSent, Record, Vals::Kind, Unavailable),
    (CommitNotSent, DupPointer, Vals::Kind, Unavailable),
    // Another key's pointer (a collision) is left as it is.
    (
        CommitNotSent,
        DupPointer,
        Vals::Set(&[b"kzz"]),
        Writes("OK"),
    ),
    (CommitNotSent, DupPointer, Vals::Delete, Writes("OK")),
    (CommitNotSent, OpenMember, Vals::Kind, Unavailable),
    (CommitNotSent, OpenMember, Vals::Delete, Unavailable),
    (CommitNotSent, HeldMember, Vals::Kind, Unavailable),
    (CommitNotSent, HeldMember, Vals::Delete, Unavailable),
    (CommitNotSent, KeyType("permit"), Vals::Kind, Unavailable),
    (CommitNotSent, KeyType("attempts"), Vals::Kind, Unavailable),
    (CommitNotSent, KeyType("open"), Vals::Kind, Unavailable),
    (CommitNotSent, KeyType("dup"), Vals::Kind, Unavailable),
    (CommitNotSent, KeyType("held"), Vals::Kind, Unavailable),
    (CommitNotSent, KeyType("uncertain"), Vals::Kind, Unavailable),
    (
        CommitNotSent,
        KeyType("uncertain_t"),
        Vals::Kind,
        Unavailable,
    ),
    (CommitSucceeded, Field("exp"), Vals::Kind, Unavailable),
    (CommitSucceeded, Field("budget"), Vals::Kind, Unavailable),
    (CommitSucceeded, Field("committed"), Vals::Kind, Unavailable),
    (CommitSucceeded, Field("reserved"), Vals::Kind, Unavailable),
    (CommitSucceeded, Field("open"), Vals::Kind, Unavailable),
    (
        CommitSucceeded,
        Field("open"),
        Vals::Set(&[b"1", b"3"]),
        Unavailable,
    ),
    (CommitSucceeded, Field("n:"), Vals::Kind, Unavailable),
    (CommitSucceeded, Field("t:"), Vals::Kind, Unavailable),
    (CommitSucceeded, Field("upol"), Vals::Kind, Unavailable),
    (CommitSucceeded, Field("fa"), Vals::Kind, Unavailable),
    (CommitSucceeded, OpenMember, Vals::Kind, Unavailable),
    (CommitSucceeded, HeldMember, Vals::Kind, Unavailable),
    // Only a NotSent moves the guard's pointer.
    (CommitSucceeded, KeyType("dup"), Vals::Kind, Writes("OK")),
    (ResolveUncertain, Record, Vals::Kind, Unavailable),
    (ResolveUncertain, OpenMember, Vals::Kind, Unavailable),
    (ResolveUncertain, OpenMember, Vals::Delete, Unavailable),
    (ResolveUncertain, HeldMember, Vals::Kind, Unavailable),
    (ResolveUncertain, HeldMember, Vals::Delete, Unavailable),
    // An operator is not limited to the permit's agents.
    (
        ResolveUncertain,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Writes("OK"),
    ),
    // --- mark_uncertain.lua
    (MarkUncertain, Field("exp"), Vals::Kind, Unavailable),
    (MarkUncertain, Field("upol"), Vals::Kind, Unavailable),
    (MarkUncertain, Field("fa"), Vals::Kind, Unavailable),
    (MarkUncertain, Field("open"), Vals::Kind, Unavailable),
    (
        MarkUncertain,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (
        MarkUncertain,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (MarkUncertain, Record, Vals::Kind, Unavailable),
    (MarkUncertain, OpenMember, Vals::Kind, Unavailable),
    (MarkUncertain, OpenMember, Vals::Delete, Unavailable),
    (MarkUncertain, HeldMember, Vals::Kind, Unavailable),
    (MarkUncertain, HeldMember, Vals::Delete, Unavailable),
    (MarkUncertain, KeyType("permit"), Vals::Kind, Unavailable),
    (MarkUncertain, KeyType("attempts"), Vals::Kind, Unavailable),
    (MarkUncertain, KeyType("open"), Vals::Kind, Unavailable),
    (MarkUncertain, KeyType("held"), Vals::Kind, Unavailable),
    (MarkUncertain, KeyType("uncertain"), Vals::Kind, Unavailable),
    (
        MarkUncertain,
        KeyType("uncertain_t"),
        Vals::Kind,
        Unavailable,
    ),
    // --- revoke_permit.lua: the whole record, which it answers with.
    (Revoke, Field("subject"), Vals::Kind, Unavailable),
    (Revoke, Field("currency"), Vals::Kind, Unavailable),
    (Revoke, Field("tools"), Vals::Kind, Unavailable),
    (Revoke, Field("exp"), Vals::Kind, Unavailable),
    (Revoke, Field("lease"), Vals::Kind, Unavailable),
    (Revoke, Field("gmode"), Vals::Kind, Unavailable),
    (Revoke, Field("gwin"), Vals::Kind, Unavailable),
    (Revoke, Field("status"), Vals::Kind, Unavailable),
    (Revoke, Field("created"), Vals::Kind, Unavailable),
    (Revoke, Field("budget"), Vals::Kind, Unavailable),
    (Revoke, Field("upol"), Vals::Kind, Unavailable),
    (Revoke, Field("t:"), Vals::Kind, Unavailable),
    (Revoke, Field("t:"), Vals::Delete, Unavailable),
    (Revoke, Field("n:"), Vals::Kind, Unavailable),
    (Revoke, Field("committed"), Vals::Kind, Unavailable),
    (Revoke, Field("reserved"), Vals::Kind, Unavailable),
    (Revoke, Field("open"), Vals::Kind, Unavailable),
    (Revoke, Field("fa"), Vals::Kind, Unavailable),
    (Revoke, Field("closed"), Vals::Kind, Unavailable),
    (
        Revoke,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    // An operator is not limited to the agents, but answers them.
    (
        Revoke,
        Field("agents"),
        Vals::Set(&[b"\xff", b"", b"a1\n\na2", b"a b"]),
        Unavailable,
    ),
    (Revoke, KeyType("permit"), Vals::Kind, Unavailable),
    // Read only when the permit hash is gone.
    (Revoke, KeyType("attempts"), Vals::Kind, Writes("OK")),
    // --- close_permit.lua
    (Close, Field("exp"), Vals::Kind, Unavailable),
    (Close, Field("open"), Vals::Kind, Unavailable),
    (Close, Field("fa"), Vals::Kind, Unavailable),
    (Close, Field("closed"), Vals::Kind, Unavailable),
    (Close, KeyType("permit"), Vals::Kind, Unavailable),
    (Close, KeyType("attempts"), Vals::Kind, Writes("dropped 2")),
    // --- create_permit.lua: whether the id is taken.
    (Create, KeyType("permit"), Vals::Kind, Unavailable),
    // --- index_permit.lua
    // Already indexed, whatever its score: nothing to add.
    (Index, IndexMember, Vals::OwnMember, Unchanged("OK")),
    // The other members are read only as a count (ZLEXCOUNT): one that
    // does not begin with an expiry sorts with the unexpired ones and
    // counts against the quota (fail closed); none is read one by one.
    (Index, IndexMember, Vals::AddMember("x"), Writes("OK")),
    (Index, KeyType("index"), Vals::Kind, Unavailable),
    // --- index_tenant.lua
    // The tenant's earlier members are only removed, whatever they hold,
    // and another tenant's are never read: any value is one it may
    // replace or leave.
    (
        IndexTenant,
        TenantMember,
        Vals::AddMember("acme\n\u{1}"),
        Writes("OK"),
    ),
    (
        IndexTenant,
        TenantMember,
        Vals::AddMember("acme\n"),
        Writes("OK"),
    ),
    (
        IndexTenant,
        TenantMember,
        Vals::AddMember("acmf"),
        Writes("OK"),
    ),
    (IndexTenant, KeyType("tenants"), Vals::Kind, Unavailable),
    // --- get_permit.lua (read-only): the whole record, which it answers.
    (GetPermit, Field("subject"), Vals::Kind, Unavailable),
    (GetPermit, Field("currency"), Vals::Kind, Unavailable),
    (GetPermit, Field("tools"), Vals::Kind, Unavailable),
    (GetPermit, Field("exp"), Vals::Kind, Unavailable),
    (GetPermit, Field("lease"), Vals::Kind, Unavailable),
    (GetPermit, Field("gmode"), Vals::Kind, Unavailable),
    (GetPermit, Field("gwin"), Vals::Kind, Unavailable),
    (GetPermit, Field("status"), Vals::Kind, Unavailable),
    (GetPermit, Field("created"), Vals::Kind, Unavailable),
    (GetPermit, Field("budget"), Vals::Kind, Unavailable),
    (GetPermit, Field("upol"), Vals::Kind, Unavailable),
    (GetPermit, Field("t:"), Vals::Kind, Unavailable),
    (GetPermit, Field("t:"), Vals::Delete, Unavailable),
    (GetPermit, Field("n:"), Vals::Kind, Unavailable),
    (GetPermit, Field("committed"), Vals::Kind, Unavailable),
    (GetPermit, Field("reserved"), Vals::Kind, Unavailable),
    (GetPermit, Field("open"), Vals::Kind, Unavailable),
    (GetPermit, Field("fa"), Vals::Kind, Unavailable),
    (GetPermit, Field("closed"), Vals::Kind, Unavailable),
    (
        GetPermit,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (
        GetPermit,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (GetPermit, KeyType("permit"), Vals::Kind, Unavailable),
    (GetPermit, KeyType("attempts"), Vals::Kind, Unchanged("OK")),
    // --- get_attempt.lua (read-only)
    (GetAttempt, Field("exp"), Vals::Kind, Unavailable),
    (GetAttempt, Field("fa"), Vals::Kind, Unavailable),
    (GetAttempt, Field("open"), Vals::Kind, Unavailable),
    (
        GetAttempt,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (
        GetAttempt,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (GetAttempt, Record, Vals::Kind, Unavailable),
    (GetAttempt, KeyType("permit"), Vals::Kind, Unavailable),
    (GetAttempt, KeyType("attempts"), Vals::Kind, Unavailable),
    // --- list_uncertain.lua (read-only)
    (ListUncertain, Field("exp"), Vals::Kind, Unavailable),
    (ListUncertain, Field("open"), Vals::Kind, Unavailable),
    (ListUncertain, Field("fa"), Vals::Kind, Unavailable),
    (
        ListUncertain,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (
        ListUncertain,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (ListUncertain, Record, Vals::Kind, Unavailable),
    (ListUncertain, OpenMember, Vals::Kind, Unavailable),
    // A member gone, or moved past `now`, is not in the range the listing
    // reads: it reads the open set, not every attempt.
    (
        ListUncertain,
        OpenMember,
        Vals::Delete,
        Unchanged("0 listed"),
    ),
    (
        ListUncertain,
        OpenMember,
        Vals::OutOfRange,
        Unchanged("0 listed"),
    ),
    (ListUncertain, KeyType("permit"), Vals::Kind, Unavailable),
    (ListUncertain, KeyType("attempts"), Vals::Kind, Unavailable),
    (ListUncertain, KeyType("open"), Vals::Kind, Unavailable),
    // --- census.lua (read-only): counts the fleet's shard, and reads the
    // first member's time.
    (Census, UncertainMember, Vals::Shapes, Unavailable),
    (Census, KeyType("uncertain"), Vals::Kind, Unavailable),
    // --- census_turn.lua: the figures and the turn.
    (
        CensusTurn,
        CensusField("uncertain"),
        Vals::Kind,
        Unavailable,
    ),
    (CensusTurn, CensusField("oldest"), Vals::Kind, Unavailable),
    (CensusTurn, CensusField("at"), Vals::Kind, Unavailable),
    (CensusTurn, CensusField("until"), Vals::Kind, Unavailable),
    (CensusTurn, KeyType("census"), Vals::Kind, Unavailable),
    // --- census_publish.lua: the same fields, read by the turn first.
    (CensusPublish, CensusField("at"), Vals::Kind, Unavailable),
    // Any replica's token: the turn is only ended if it was this one's.
    (
        CensusPublish,
        CensusField("by"),
        Vals::Set(&[b"", b"\xff"]),
        Writes("1 uncertain"),
    ),
    (CensusPublish, KeyType("census"), Vals::Kind, Unavailable),
    // --- list_index.lua (read-only): the tenant's shard; the members it
    // names are parsed by the store.
    (ListIndex, UncertainMember, Vals::Shapes, Unavailable),
    (ListIndex, KeyType("uncertain_t"), Vals::Kind, Unavailable),
    // --- uncertain_attempts.lua (read-only)
    (ListAttempts, Field("exp"), Vals::Kind, Unavailable),
    (ListAttempts, Field("open"), Vals::Kind, Unavailable),
    (ListAttempts, Field("fa"), Vals::Kind, Unavailable),
    // Another tenant's permit, or not the caller's agents: nothing of it
    // is listed.
    (
        ListAttempts,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("0 listed"),
    ),
    (
        ListAttempts,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Unchanged("0 listed"),
    ),
    (ListAttempts, Record, Vals::Kind, Unavailable),
    // k1's member gone from the open set while the index still names it:
    // the index and the open set are written in the same step, so the
    // records disagree (never a silent gap in the listing).
    (ListAttempts, OpenMember, Vals::Delete, Unavailable),
    (ListAttempts, KeyType("permit"), Vals::Kind, Unavailable),
    (ListAttempts, KeyType("attempts"), Vals::Kind, Unavailable),
    (ListAttempts, KeyType("open"), Vals::Kind, Unavailable),
    // The tenant's shard is read first (list_index.lua).
    (ListAttempts, UncertainMember, Vals::Shapes, Unavailable),
    (
        ListAttempts,
        KeyType("uncertain_t"),
        Vals::Kind,
        Unavailable,
    ),
    // --- authorize.lua, with an approval rule (tool u; k3 requested)
    (AuthorizeWaits, Field("appr"), Vals::Kind, Unavailable),
    // A rule on a permit that does not say it has one.
    (AuthorizeWaits, Field("appr"), Vals::Delete, Unavailable),
    (AuthorizeWaits, Field("ap:"), Vals::Kind, Unavailable),
    // No rule: a call like any other.
    (
        AuthorizeWaits,
        Field("ap:"),
        Vals::Delete,
        Writes("DISPATCH"),
    ),
    // Members up to `now` name calls whose lapse is due.
    (AuthorizeWaits, PendingMember, Vals::Kind, Unavailable),
    (AuthorizeWaits, KeyType("pending"), Vals::Kind, Unavailable),
    (AuthorizeWaits, KeyType("awaiting"), Vals::Kind, Unavailable),
    (
        AuthorizeWaits,
        KeyType("approvals_t"),
        Vals::Kind,
        Unavailable,
    ),
    (AuthorizeLapse, PendingMember, Vals::Kind, Unavailable),
    (AuthorizeLapse, Record, Vals::Kind, Unavailable),
    // The lapsed call's tool's slots, and the reserved money, must hold it.
    (AuthorizeLapse, Field("n:"), Vals::Kind, Unavailable),
    (AuthorizeLapse, Field("n:"), Vals::Set(&[b"0"]), Unavailable),
    (
        AuthorizeLapse,
        Field("reserved"),
        Vals::Set(&[b"0"]),
        Unavailable,
    ),
    (AuthorizeLapse, KeyType("awaiting"), Vals::Kind, Unavailable),
    (AuthorizeClaim, PendingMember, Vals::Delete, Unavailable),
    (AuthorizeClaim, Record, Vals::Kind, Unavailable),
    (AuthorizeClaim, KeyType("pending"), Vals::Kind, Unavailable),
    (AuthorizeClaim, KeyType("open"), Vals::Kind, Unavailable),
    // --- settle.lua: the lapse first
    (CommitLapse, Field("appr"), Vals::Kind, Unavailable),
    (CommitLapse, Field("n:"), Vals::Kind, Unavailable),
    (CommitLapse, PendingMember, Vals::Kind, Unavailable),
    (CommitLapse, Record, Vals::Kind, Unavailable),
    (CommitLapse, KeyType("pending"), Vals::Kind, Unavailable),
    (CommitLapse, KeyType("awaiting"), Vals::Kind, Unavailable),
    (CommitLapse, KeyType("approvals_t"), Vals::Kind, Unavailable),
    // --- mark_uncertain.lua: the lapse first
    (MarkLapse, Field("appr"), Vals::Kind, Unavailable),
    (MarkLapse, PendingMember, Vals::Kind, Unavailable),
    (MarkLapse, Record, Vals::Kind, Unavailable),
    (MarkLapse, KeyType("pending"), Vals::Kind, Unavailable),
    (MarkLapse, KeyType("awaiting"), Vals::Kind, Unavailable),
    (MarkLapse, KeyType("approvals_t"), Vals::Kind, Unavailable),
    // --- approve.lua
    (ApproveWaiting, Field("exp"), Vals::Kind, Unavailable),
    (ApproveWaiting, Field("fa"), Vals::Kind, Unavailable),
    (ApproveWaiting, Field("open"), Vals::Kind, Unavailable),
    (ApproveWaiting, Field("lease"), Vals::Kind, Unavailable),
    (ApproveWaiting, Field("appr"), Vals::Kind, Unavailable),
    (
        ApproveWaiting,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    // An approver is not limited to the permit's agents.
    (
        ApproveWaiting,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Writes("OK"),
    ),
    (ApproveWaiting, Record, Vals::Kind, Unavailable),
    (ApproveWaiting, PendingMember, Vals::Kind, Unavailable),
    (ApproveWaiting, PendingMember, Vals::Delete, Unavailable),
    (ApproveWaiting, AwaitingMember, Vals::Delete, Unavailable),
    (ApproveWaiting, KeyType("permit"), Vals::Kind, Unavailable),
    (ApproveWaiting, KeyType("attempts"), Vals::Kind, Unavailable),
    (ApproveWaiting, KeyType("pending"), Vals::Kind, Unavailable),
    (ApproveWaiting, KeyType("awaiting"), Vals::Kind, Unavailable),
    (
        ApproveWaiting,
        KeyType("approvals_t"),
        Vals::Kind,
        Unavailable,
    ),
    // --- deny.lua
    (DenyWaiting, Field("exp"), Vals::Kind, Unavailable),
    (DenyWaiting, Field("fa"), Vals::Kind, Unavailable),
    (DenyWaiting, Field("open"), Vals::Kind, Unavailable),
    (DenyWaiting, Field("budget"), Vals::Kind, Unavailable),
    (DenyWaiting, Field("committed"), Vals::Kind, Unavailable),
    (DenyWaiting, Field("reserved"), Vals::Kind, Unavailable),
    (
        DenyWaiting,
        Field("reserved"),
        Vals::Set(&[b"0"]),
        Unavailable,
    ),
    (DenyWaiting, Field("appr"), Vals::Kind, Unavailable),
    (DenyWaiting, Field("t:"), Vals::Kind, Unavailable),
    (DenyWaiting, Field("t:"), Vals::Delete, Unavailable),
    (DenyWaiting, Field("n:"), Vals::Kind, Unavailable),
    (DenyWaiting, Field("n:"), Vals::Delete, Unavailable),
    (DenyWaiting, Field("n:"), Vals::Set(&[b"0"]), Unavailable),
    (
        DenyWaiting,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    (
        DenyWaiting,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Writes("OK"),
    ),
    (DenyWaiting, Record, Vals::Kind, Unavailable),
    (DenyWaiting, PendingMember, Vals::Kind, Unavailable),
    (DenyWaiting, PendingMember, Vals::Delete, Unavailable),
    (DenyWaiting, KeyType("permit"), Vals::Kind, Unavailable),
    (DenyWaiting, KeyType("attempts"), Vals::Kind, Unavailable),
    (DenyWaiting, KeyType("pending"), Vals::Kind, Unavailable),
    (DenyWaiting, KeyType("awaiting"), Vals::Kind, Unavailable),
    (DenyWaiting, KeyType("approvals_t"), Vals::Kind, Unavailable),
    // --- revoke_permit.lua: every pending call denied
    (RevokePending, Field("appr"), Vals::Kind, Unavailable),
    // A rule on a permit that does not say it has one.
    (RevokePending, Field("appr"), Vals::Delete, Unavailable),
    (RevokePending, Field("ap:"), Vals::Kind, Unavailable),
    (RevokePending, Field("n:"), Vals::Set(&[b"0"]), Unavailable),
    (
        RevokePending,
        Field("reserved"),
        Vals::Set(&[b"0"]),
        Unavailable,
    ),
    (RevokePending, PendingMember, Vals::Kind, Unavailable),
    (RevokePending, Record, Vals::Kind, Unavailable),
    (RevokePending, KeyType("pending"), Vals::Kind, Unavailable),
    (RevokePending, KeyType("awaiting"), Vals::Kind, Unavailable),
    (
        RevokePending,
        KeyType("approvals_t"),
        Vals::Kind,
        Unavailable,
    ),
    // --- get_permit.lua (read-only): lapsed calls' slots and costs
    (GetPermitLapsed, Field("appr"), Vals::Kind, Unavailable),
    (GetPermitLapsed, Field("ap:"), Vals::Kind, Unavailable),
    (
        GetPermitLapsed,
        Field("n:"),
        Vals::Set(&[b"0"]),
        Unavailable,
    ),
    (
        GetPermitLapsed,
        Field("reserved"),
        Vals::Set(&[b"0"]),
        Unavailable,
    ),
    (GetPermitLapsed, PendingMember, Vals::Kind, Unavailable),
    (GetPermitLapsed, Record, Vals::Kind, Unavailable),
    (GetPermitLapsed, KeyType("pending"), Vals::Kind, Unavailable),
    // --- get_attempt.lua (read-only): a call awaiting approval
    (GetAttemptWaiting, Record, Vals::Kind, Unavailable),
    // --- list_approvals.lua (read-only)
    (ListApprovals, Field("exp"), Vals::Kind, Unavailable),
    (ListApprovals, Field("open"), Vals::Kind, Unavailable),
    (ListApprovals, Field("fa"), Vals::Kind, Unavailable),
    (
        ListApprovals,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("PERMIT_NOT_FOUND"),
    ),
    // Listed by an approver, not limited to the agents.
    (
        ListApprovals,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Unchanged("1 listed"),
    ),
    (ListApprovals, Record, Vals::Kind, Unavailable),
    (ListApprovals, AwaitingMember, Vals::Kind, Unavailable),
    // The listing reads the awaiting set, not every attempt.
    (
        ListApprovals,
        AwaitingMember,
        Vals::Delete,
        Unchanged("0 listed"),
    ),
    (ListApprovals, KeyType("permit"), Vals::Kind, Unavailable),
    (ListApprovals, KeyType("attempts"), Vals::Kind, Unavailable),
    (ListApprovals, KeyType("awaiting"), Vals::Kind, Unavailable),
    // --- list_index.lua (read-only), the approvals index's shard
    (
        ListApprovalsIndex,
        ApprovalsMember,
        Vals::Shapes,
        Unavailable,
    ),
    (
        ListApprovalsIndex,
        KeyType("approvals_t"),
        Vals::Kind,
        Unavailable,
    ),
    // --- awaiting_attempts.lua (read-only)
    (ListAwaiting, Field("exp"), Vals::Kind, Unavailable),
    (ListAwaiting, Field("open"), Vals::Kind, Unavailable),
    (ListAwaiting, Field("fa"), Vals::Kind, Unavailable),
    (
        ListAwaiting,
        Field("ten"),
        Vals::Set(OTHER_TENANT),
        Unchanged("0 listed"),
    ),
    (
        ListAwaiting,
        Field("agents"),
        Vals::Set(OTHER_AGENTS),
        Unchanged("1 listed"),
    ),
    (ListAwaiting, Record, Vals::Kind, Unavailable),
    (ListAwaiting, KeyType("permit"), Vals::Kind, Unavailable),
    (ListAwaiting, KeyType("attempts"), Vals::Kind, Unavailable),
    // --- close_permit.lua: the approvals index's entries of its lapsed
    // requests dropped
    (ClosePending, Field("appr"), Vals::Kind, Unavailable),
    (ClosePending, AwaitingMember, Vals::Shapes, Unavailable),
    // Nothing to drop from the index.
    (
        ClosePending,
        AwaitingMember,
        Vals::Delete,
        Writes("dropped 2"),
    ),
    (ClosePending, KeyType("awaiting"), Vals::Kind, Unavailable),
    (
        ClosePending,
        KeyType("approvals_t"),
        Vals::Kind,
        Unavailable,
    ),
    // Only the index's type is read (its members are only removed).
    (
        ClosePending,
        ApprovalsMember,
        Vals::Shapes,
        Writes("dropped 2"),
    ),
];

/// The scenarios whose every record element is corrupted in turn (each
/// reads its subject's record: load_attempt), with [`Vals::Kind`],
/// expecting UNAVAILABLE; listed here rather than as 17 rows each.
const ELEMENT_SCENARIOS: [Scenario; 21] = [
    AuthorizeNew,
    AuthorizeReleased,
    AuthorizeHeld,
    CommitNotSent,
    CommitSucceeded,
    ResolveUncertain,
    MarkUncertain,
    GetAttempt,
    ListUncertain,
    ListAttempts,
    // k3's record, with its approval.
    AuthorizeLapse,
    AuthorizeClaim,
    CommitLapse,
    MarkLapse,
    ApproveWaiting,
    DenyWaiting,
    RevokePending,
    GetPermitLapsed,
    GetAttemptWaiting,
    ListApprovals,
    ListAwaiting,
];

/// Elements 1..=16 of the record (16: the approval), and one past them.
const ELEMENTS: usize = 17;

/// [`TABLE`], with a row per record element for [`ELEMENT_SCENARIOS`].
fn table() -> Vec<(Scenario, Target, Vals, Expect)> {
    let mut rows = TABLE.to_vec();
    for scenario in ELEMENT_SCENARIOS {
        for i in 1..=ELEMENTS {
            rows.push((scenario, Element(i), Vals::Kind, Unavailable));
        }
    }
    rows
}

// === the state ===

/// 2100-01-01 (as tests/model.rs): Redis expires keys on its own clock,
/// the scripts decide on this one.
const T0: Millis = 4_102_444_800_000;
const SETUP: Millis = T0 + 1_000;
const MARK: Millis = T0 + 2_000;
const OP: Millis = T0 + 3_000;
const EXPIRES: Millis = T0 + 3_600_000;
const LEASE_MS: Millis = 30_000;
const TOOL: &str = "t";
/// The waits of tool u's approval rule: k3 (requested at SETUP) lapses
/// before OP, or waits past it (until the permit's expiry).
const SHORT_WAIT: Millis = 1_500;
const LONG_WAIT: Millis = 7_200_000;
/// k3's request's summary (its approval's first field).
const SUMMARY: &str = "charge 1 to order 3";

/// An approver's key: not limited to the permit's agents.
fn approver() -> Scope {
    Scope {
        tenant: "acme".into(),
        agent: None,
        key_id: "ap1".into(),
    }
}

/// k3's deadline in `scenario` (the permit's expiry caps it).
fn k3_deadline(scenario: Scenario) -> Millis {
    (SETUP + scenario.wait().unwrap_or(0)).min(EXPIRES)
}

fn agent() -> Scope {
    Scope {
        tenant: "acme".into(),
        agent: Some("a1".into()),
        key_id: "a1".into(),
    }
}

fn operator() -> Scope {
    Scope {
        tenant: "acme".into(),
        agent: None,
        key_id: "admin".into(),
    }
}

/// Tools t (cap 5) and u, a budget, the LOG guard and HOLD_TOOL, so that
/// every field, the guard's pointer and the held set are read.
fn permit(id: &str) -> Permit {
    Permit {
        permit_id: id.to_owned(),
        subject: "corruption".into(),
        tools: vec![TOOL.into(), "u".into()],
        max_calls_per_tool: [(TOOL.to_owned(), 5)].into(),
        budget: Some(100),
        currency: "EUR".into(),
        expires_at: EXPIRES,
        lease_ms: LEASE_MS,
        duplicate_guard: DuplicateGuard {
            mode: GuardMode::Log,
            window_ms: 600_000,
        },
        uncertain_policy: UncertainPolicy::HoldTool,
        status: PermitStatus::Active,
        created_at: T0,
        tenant: "acme".into(),
        agents: vec!["a1".into()],
        approval_per_tool: Default::default(),
    }
}

/// [`permit`], with tool u's calls needing one approval, waiting `wait`.
fn permit_with_rule(id: &str, wait: Millis) -> Permit {
    let mut p = permit(id);
    p.approval_per_tool.insert(
        "u".into(),
        ApprovalRule {
            cost_at_least: None,
            wait_ms: wait,
            approvers: 1,
        },
    );
    p
}

/// One case's store: a prefix of its own, so the sweep and the census see
/// its permit alone, and the snapshot is every key under the prefix.
struct Ctx {
    store: RedisStore,
    prefix: String,
    permit_id: String,
    /// k1's attempt id, and its place in the open set (its lease while
    /// RESERVED, since when it is uncertain once UNCERTAIN).
    k1_id: String,
    k1_at: Millis,
    /// k3's attempt id, on a permit with an approval rule.
    k3_id: String,
    scenario: Scenario,
}

impl Ctx {
    fn key(&self, name: &str) -> String {
        match name {
            "index" => format!("{}:permits:acme", self.prefix),
            "tenants" => format!("{}:tenants", self.prefix),
            "uncertain" => format!("{}:uncertain:{{0}}", self.prefix),
            "uncertain_t" => format!("{}:uncertain:{{0}}:t:acme", self.prefix),
            "approvals_t" => format!("{}:approvals:{{0}}:t:acme", self.prefix),
            "census" => format!("{}:census:{{c}}", self.prefix),
            name => format!("{}:{{{}}}:{name}", self.prefix, self.permit_id),
        }
    }
}

/// An attempt's member of the open set, or of the held set, at `at` (or
/// of the pending or awaiting set).
fn member(target: Target, at: Millis, key: &str) -> String {
    let prefix = if target == HeldMember { "t\n" } else { "" };
    format!("{prefix}{at:015}:{key}")
}

/// k3's own member of the pending set (its deadline) or of the awaiting
/// set (its creation).
fn k3_member(scenario: Scenario, target: Target) -> String {
    match target {
        PendingMember => member(target, k3_deadline(scenario), "k3"),
        _ => member(target, SETUP, "k3"),
    }
}

/// k1's place in the open set: its lease while RESERVED, since when it is
/// uncertain once marked.
fn k1_at(scenario: Scenario) -> Millis {
    match scenario {
        AuthorizeHeld | ResolveUncertain | ListUncertain | Census | CensusTurn | CensusPublish
        | ListIndex | ListAttempts => MARK,
        _ => SETUP + LEASE_MS,
    }
}

fn authorize_cmd(permit_id: &str, key: &str, fp: &[u8]) -> AuthorizeCmd {
    AuthorizeCmd {
        permit_id: permit_id.to_owned(),
        tool: TOOL.into(),
        idempotency_key: key.into(),
        request_fingerprint: fp.to_vec(),
        cost: 1,
        holder_token: format!("token-{key}").into_bytes(),
        approval_summary: String::new(),
    }
}

async fn dispatch(ctx: &Ctx, key: &str, fp: &[u8]) -> atmost::domain::Attempt {
    let a = ctx
        .store
        .authorize(
            &agent(),
            &authorize_cmd(&ctx.permit_id, key, fp),
            SETUP,
            new_id(SETUP),
        )
        .await
        .expect("dispatch");
    assert_eq!(a.decision, Decision::Dispatch);
    a.attempt
}

async fn mark(ctx: &Ctx, id: &str) -> atmost::domain::Attempt {
    ctx.store
        .mark_uncertain(&agent(), &mark_cmd(&ctx.permit_id, id), MARK)
        .await
        .expect("mark uncertain")
}

fn mark_cmd(permit_id: &str, id: &str) -> MarkUncertainCmd {
    MarkUncertainCmd {
        permit_id: permit_id.to_owned(),
        idempotency_key: "k1".into(),
        attempt_id: id.to_owned(),
        reason: "lost".into(),
    }
}

fn commit_cmd(ctx: &Ctx, outcome: Outcome) -> CommitCmd {
    CommitCmd {
        permit_id: ctx.permit_id.clone(),
        idempotency_key: "k1".into(),
        attempt_id: ctx.k1_id.clone(),
        outcome,
    }
}

/// The scenario's state, in a store of its own.
async fn build(
    redis: &Redis,
    n: usize,
    scenario: Scenario,
    conn: &mut MultiplexedConnection,
) -> Ctx {
    let prefix = format!("{}c{n}", redis.prefix);
    let mut ctx = Ctx {
        store: redis_store(&redis.url, &prefix, Duration::from_secs(5)),
        prefix,
        permit_id: new_id(T0),
        k1_id: String::new(),
        k1_at: 0,
        k3_id: String::new(),
        scenario,
    };
    if matches!(scenario, Create | Index | IndexTenant) {
        return ctx;
    }
    let p = match scenario.wait() {
        Some(wait) => permit_with_rule(&ctx.permit_id, wait),
        None => permit(&ctx.permit_id),
    };
    ctx.store.create_permit(p).await.expect("create");
    let k1 = dispatch(&ctx, "k1", b"fp").await;
    ctx.k1_id = k1.attempt_id.clone();
    ctx.k1_at = k1.lease_expires_at;
    if scenario.wait().is_some() {
        let k3 = ctx
            .store
            .authorize(&agent(), &k3_cmd(&ctx.permit_id), SETUP, new_id(SETUP))
            .await
            .expect("k3 requested");
        assert_eq!(k3.decision, Decision::AwaitApproval, "{scenario:?}: k3");
        ctx.k3_id = k3.attempt.attempt_id;
    }
    match scenario {
        AuthorizeClaim => {
            let approved = ctx
                .store
                .approve(&approver(), &approve_cmd(&ctx), MARK)
                .await
                .expect("k3 approved");
            assert_eq!(
                approved.approval.expect("an approval").expires_at,
                k3_deadline(scenario),
                "k3's claim deadline is its request's"
            );
        }
        ClosePending => {
            let cmd = commit_cmd(
                &ctx,
                Outcome::Succeeded {
                    result: b"ok".to_vec(),
                    actual_cost: None,
                },
            );
            ctx.store
                .commit(&agent(), &cmd, MARK, new_id(MARK))
                .await
                .expect("commit");
        }
        AuthorizeReleased => {
            let cmd = commit_cmd(&ctx, Outcome::NotSent);
            ctx.store
                .commit(&agent(), &cmd, MARK, new_id(MARK))
                .await
                .expect("release");
        }
        AuthorizeHeld | ResolveUncertain | ListUncertain | Census | ListIndex | ListAttempts => {
            ctx.k1_at = mark(&ctx, &ctx.k1_id).await.uncertain_since;
        }
        CensusTurn | CensusPublish => {
            ctx.k1_at = mark(&ctx, &ctx.k1_id).await.uncertain_since;
            // Figures published long before: stale, so the call counts.
            let _: () = redis::cmd("HSET")
                .arg(ctx.key("census"))
                .arg("uncertain")
                .arg("0")
                .arg("oldest")
                .arg("0")
                .arg("at")
                .arg((T0 - 60_000).to_string())
                .query_async(&mut *conn)
                .await
                .expect("old figures");
        }
        CommitSucceeded => {
            dispatch(&ctx, "k2", b"fp2").await;
        }
        Close => {
            let cmd = commit_cmd(
                &ctx,
                Outcome::Succeeded {
                    result: b"ok".to_vec(),
                    actual_cost: None,
                },
            );
            ctx.store
                .commit(&agent(), &cmd, MARK, new_id(MARK))
                .await
                .expect("commit");
        }
        _ => {}
    }
    if scenario != AuthorizeReleased && scenario != Close {
        assert_eq!(ctx.k1_at, k1_at(scenario), "{scenario:?}: k1's place");
    }
    ctx
}

/// k3's request: tool u, which needs approval.
fn k3_cmd(permit_id: &str) -> AuthorizeCmd {
    AuthorizeCmd {
        tool: "u".into(),
        approval_summary: SUMMARY.into(),
        ..authorize_cmd(permit_id, "k3", b"fp3")
    }
}

fn approve_cmd(ctx: &Ctx) -> ApproveCmd {
    ApproveCmd {
        permit_id: ctx.permit_id.clone(),
        idempotency_key: "k3".into(),
        attempt_id: ctx.k3_id.clone(),
    }
}

/// The scenario's call, and its answer: the verdict, the error's reason,
/// or what a listing or a sweep found.
async fn call(
    ctx: &Ctx,
    scenario: Scenario,
    conn: &mut MultiplexedConnection,
) -> Result<String, Error> {
    let store = &ctx.store;
    let id = &ctx.permit_id;
    let authorized = |r: atmost::domain::Authorized| match r.decision {
        Decision::Dispatch if r.redelivered => "REDELIVERED".to_owned(),
        Decision::Dispatch => "DISPATCH".to_owned(),
        Decision::Replay => "REPLAY".to_owned(),
        Decision::AwaitApproval => "AWAIT_APPROVAL".to_owned(),
    };
    fn ok<T>(_: T) -> String {
        "OK".to_owned()
    }
    match scenario {
        AuthorizeNew => store
            .authorize(&agent(), &authorize_cmd(id, "k2", b"fp"), OP, new_id(OP))
            .await
            .map(authorized),
        AuthorizeReleased => store
            .authorize(&agent(), &authorize_cmd(id, "k1", b"fp"), OP, new_id(OP))
            .await
            .map(authorized),
        AuthorizeHeld => store
            .authorize(&agent(), &authorize_cmd(id, "k2", b"fp2"), OP, new_id(OP))
            .await
            .map(authorized),
        CommitNotSent => store
            .commit(&agent(), &commit_cmd(ctx, Outcome::NotSent), OP, new_id(OP))
            .await
            .map(ok),
        CommitSucceeded => {
            let outcome = Outcome::Succeeded {
                result: b"ok".to_vec(),
                actual_cost: None,
            };
            store
                .commit(&agent(), &commit_cmd(ctx, outcome), OP, new_id(OP))
                .await
                .map(ok)
        }
        ResolveUncertain => {
            let cmd = ResolveCmd {
                permit_id: id.clone(),
                idempotency_key: "k1".into(),
                attempt_id: ctx.k1_id.clone(),
                outcome: Outcome::Failed {
                    reason: "declined".into(),
                },
            };
            store
                .resolve(&operator(), &cmd, OP, new_id(OP))
                .await
                .map(ok)
        }
        MarkUncertain => store
            .mark_uncertain(&agent(), &mark_cmd(id, &ctx.k1_id), OP)
            .await
            .map(ok),
        Revoke => store.revoke_permit(&operator(), id, OP).await.map(ok),
        Close => store
            .sweep(EXPIRES + INDEX_MARGIN_MS + 1_000)
            .await
            .map(|n| format!("dropped {n}")),
        Create => store.create_permit(permit(id)).await.map(ok),
        Index => {
            let args = [OP.to_string(), "100".into(), index_member(id)];
            eval(conn, "index_permit", &ctx.key("index"), &args).await
        }
        IndexTenant => {
            let args = ["acme".to_owned(), id.clone()];
            eval(conn, "index_tenant", &ctx.key("tenants"), &args).await
        }
        GetPermit => store.get_permit(&agent(), id, OP).await.map(ok),
        GetAttempt => {
            let cmd = GetAttemptCmd {
                permit_id: id.clone(),
                idempotency_key: "k1".into(),
            };
            store.get_attempt(&agent(), &cmd, OP).await.map(ok)
        }
        ListUncertain => store
            .list_uncertain(&agent(), Some(id), None, 10, OP)
            .await
            .map(|page| format!("{} listed", page.attempts.len())),
        Census => store
            .census(OP, Duration::ZERO)
            .await
            .map(|f| format!("{} uncertain", f.uncertain)),
        CensusTurn | CensusPublish => store
            .census(OP, Duration::from_secs(10))
            .await
            .map(|f| format!("{} uncertain", f.uncertain)),
        ListIndex | ListAttempts => store
            .list_uncertain(&agent(), None, None, 10, OP)
            .await
            .map(|page| format!("{} listed", page.attempts.len())),
        AuthorizeLapse => store
            .authorize(&agent(), &authorize_cmd(id, "k2", b"fp2"), OP, new_id(OP))
            .await
            .map(authorized),
        AuthorizeWaits => {
            let cmd = AuthorizeCmd {
                tool: "u".into(),
                ..authorize_cmd(id, "k4", b"fp4")
            };
            store
                .authorize(&agent(), &cmd, OP, new_id(OP))
                .await
                .map(authorized)
        }
        AuthorizeClaim => store
            .authorize(&agent(), &k3_cmd(id), OP, new_id(OP))
            .await
            .map(authorized),
        CommitLapse => {
            let outcome = Outcome::Succeeded {
                result: b"ok".to_vec(),
                actual_cost: None,
            };
            store
                .commit(&agent(), &commit_cmd(ctx, outcome), OP, new_id(OP))
                .await
                .map(ok)
        }
        MarkLapse => store
            .mark_uncertain(&agent(), &mark_cmd(id, &ctx.k1_id), OP)
            .await
            .map(ok),
        ApproveWaiting => store
            .approve(&approver(), &approve_cmd(ctx), OP)
            .await
            .map(ok),
        DenyWaiting => {
            let cmd = DenyCmd {
                permit_id: id.clone(),
                idempotency_key: "k3".into(),
                attempt_id: ctx.k3_id.clone(),
                reason: "too much".into(),
            };
            store.deny(&approver(), &cmd, OP).await.map(ok)
        }
        RevokePending => store.revoke_permit(&operator(), id, OP).await.map(ok),
        GetPermitLapsed => store.get_permit(&agent(), id, OP).await.map(ok),
        GetAttemptWaiting => {
            let cmd = GetAttemptCmd {
                permit_id: id.clone(),
                idempotency_key: "k3".into(),
            };
            store.get_attempt(&agent(), &cmd, OP).await.map(ok)
        }
        ListApprovals => store
            .list_approvals(&approver(), Some(id), None, 10, OP)
            .await
            .map(|page| format!("{} listed", page.attempts.len())),
        ListApprovalsIndex | ListAwaiting => store
            .list_approvals(&approver(), None, None, 10, OP)
            .await
            .map(|page| format!("{} listed", page.attempts.len())),
        ClosePending => store
            .sweep(EXPIRES + INDEX_MARGIN_MS + 1_000)
            .await
            .map(|n| format!("dropped {n}")),
    }
}

/// Runs a script on one key, as the store does, and names its answer: its
/// one value, or its reason (STORE_UNAVAILABLE as the store's error).
async fn eval(
    conn: &mut MultiplexedConnection,
    script: &str,
    key: &str,
    args: &[String],
) -> Result<String, Error> {
    load_library(conn).await;
    let function = atmost::store::redis::function_name(script).expect("the script");
    let packed: Result<Vec<u8>, _> = redis::cmd("FCALL")
        .arg(function)
        .arg(1)
        .arg(key)
        .arg(args)
        .query_async(conn)
        .await;
    let packed = packed.map_err(|e| Error::StoreUnavailable(e.to_string()))?;
    let values = atmost::store::redis::unpack_reply(&packed)?;
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        other => format!("{other:?}"),
    };
    match values.as_slice() {
        [ok] => Ok(text(ok)),
        [_, reason, ..] if text(reason) == "STORE_UNAVAILABLE" => {
            Err(Error::StoreUnavailable(format!("{values:?}")))
        }
        [_, reason, ..] => Ok(text(reason)),
        [] => Ok("nothing".into()),
    }
}

fn index_member(permit_id: &str) -> String {
    format!("{EXPIRES:015}:{permit_id}")
}

// === msgpack, as cmsgpack writes it ===

/// The values atmost's records hold (and those a corruption puts there).
#[derive(Clone, PartialEq)]
enum M {
    Nil,
    Bool(bool),
    Int(i64),
    F64(f64),
    Str(Vec<u8>),
    Arr(Vec<M>),
}

fn s(text: &[u8]) -> M {
    M::Str(text.to_vec())
}

/// Packs as cmsgpack does (the smallest integer and string headers), so a
/// record re-packed here with one element changed differs in that element
/// only ([`run`] checks an unchanged one packs back to the same bytes).
fn pack(m: &M, out: &mut Vec<u8>) {
    use rmp::encode::*;
    match m {
        M::Nil => write_nil(out).expect("pack"),
        M::Bool(b) => write_bool(out, *b).expect("pack"),
        M::Int(n) => {
            write_sint(out, *n).expect("pack");
        }
        M::F64(f) => write_f64(out, *f).expect("pack"),
        M::Str(b) => {
            write_str_len(out, b.len() as u32).expect("pack");
            out.extend_from_slice(b);
        }
        M::Arr(items) => {
            write_array_len(out, items.len() as u32).expect("pack");
            for item in items {
                pack(item, out);
            }
        }
    }
}

fn packed(m: &M) -> Vec<u8> {
    let mut out = Vec::new();
    pack(m, &mut out);
    out
}

fn unpack(rd: &mut &[u8]) -> M {
    use rmp::Marker;
    use rmp::decode::{RmpRead, read_marker};
    fn bytes(rd: &mut &[u8], n: usize) -> M {
        let (head, rest) = rd.split_at(n);
        *rd = rest;
        M::Str(head.to_vec())
    }
    fn array(rd: &mut &[u8], n: usize) -> M {
        M::Arr((0..n).map(|_| unpack(rd)).collect())
    }
    match read_marker(rd).expect("a msgpack marker") {
        Marker::Null => M::Nil,
        Marker::True => M::Bool(true),
        Marker::False => M::Bool(false),
        Marker::FixPos(n) => M::Int(n.into()),
        Marker::FixNeg(n) => M::Int(n.into()),
        Marker::U8 => M::Int(rd.read_data_u8().expect("u8").into()),
        Marker::U16 => M::Int(rd.read_data_u16().expect("u16").into()),
        Marker::U32 => M::Int(rd.read_data_u32().expect("u32").into()),
        Marker::U64 => M::Int(rd.read_data_u64().expect("u64") as i64),
        Marker::I8 => M::Int(rd.read_data_i8().expect("i8").into()),
        Marker::I16 => M::Int(rd.read_data_i16().expect("i16").into()),
        Marker::I32 => M::Int(rd.read_data_i32().expect("i32").into()),
        Marker::I64 => M::Int(rd.read_data_i64().expect("i64")),
        Marker::F32 => M::F64(rd.read_data_f32().expect("f32").into()),
        Marker::F64 => M::F64(rd.read_data_f64().expect("f64")),
        Marker::FixStr(n) => bytes(rd, n.into()),
        Marker::Str8 | Marker::Bin8 => {
            let n = rd.read_data_u8().expect("len");
            bytes(rd, n.into())
        }
        Marker::Str16 | Marker::Bin16 => {
            let n = rd.read_data_u16().expect("len");
            bytes(rd, n.into())
        }
        Marker::Str32 | Marker::Bin32 => {
            let n = rd.read_data_u32().expect("len");
            bytes(rd, n as usize)
        }
        Marker::FixArray(n) => array(rd, n.into()),
        Marker::Array16 => {
            let n = rd.read_data_u16().expect("len");
            array(rd, n.into())
        }
        other => panic!("{other:?} in an attempt record"),
    }
}

fn elements(raw: &[u8]) -> Vec<M> {
    match unpack(&mut &raw[..]) {
        M::Arr(items) => items,
        other => panic!("an attempt record that is not an array: {other:?}"),
    }
}

/// What save_attempt leaves off at the end of a record, by element.
fn empty_element(i: usize) -> M {
    match i {
        9 | 14 => M::Int(0),
        _ => s(b""),
    }
}

// === the corrupted values ===

/// Bytes as text, escaped (a long run of one byte shortened).
fn esc(b: &[u8]) -> String {
    if b.len() > 32 && b.iter().all(|c| *c == b[0]) {
        return format!("{}x{:?}", b.len(), char::from(b[0]));
    }
    format!("{:?}", b.escape_ascii().to_string())
}

impl std::fmt::Debug for M {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            M::Nil => write!(f, "nil"),
            M::Bool(b) => write!(f, "{b}"),
            M::Int(n) => write!(f, "{n}"),
            M::F64(x) => write!(f, "{x:?} (float)"),
            M::Str(b) => write!(f, "{}", esc(b)),
            M::Arr(items) => f.debug_list().entries(items).finish(),
        }
    }
}

impl std::fmt::Debug for Bad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bad::Set(b) => write!(f, "= {}", esc(b)),
            Bad::Delete => write!(f, "deleted"),
            Bad::Element(i, m) => write!(f, "[{i}] = {m:?}"),
            Bad::ApprovalField(i, m) => write!(f, "[16][{i}] = {m:?}"),
            Bad::Shape(i) => write!(f, "= {}", SHAPES[*i]),
            Bad::Member(m) => write!(f, "-> {}", esc(m.as_bytes())),
            Bad::Add(m, score) => write!(f, "+ {} (score {score})", esc(m.as_bytes())),
            Bad::Own(score) => write!(f, "+ its own (score {score})"),
            Bad::Type => write!(f, "a string"),
        }
    }
}

#[derive(Clone)]
enum Bad {
    /// The field (or the guard's pointer) set to these bytes.
    Set(Vec<u8>),
    /// The field, the pointer or k1's member removed.
    Delete,
    /// The subject's record with element i (1-based) replaced (or, past
    /// its end, added).
    Element(usize, M),
    /// The subject's approval (element 16) with field i (0-based)
    /// replaced (or, past its end, added).
    ApprovalField(usize, M),
    /// k1's record replaced by the i-th of [`record_values`] (made from
    /// the case's own record).
    Shape(usize),
    /// k1's member replaced by this one.
    Member(String),
    /// A member added to the index with this score.
    Add(String, i64),
    /// The permit's own index member added with this score.
    Own(i64),
    /// The key replaced by a string.
    Type,
}

/// Integers as atmost never writes them (it writes %d).
const NOT_INTEGERS: &[&[u8]] = &[
    b"x",
    b"1e3",
    b"1.5",
    b"-1",
    b" 1",
    b"01",
    b"0x10",
    b"",
    b"9007199254740992",
];

fn field_values(field: &str) -> Vec<Bad> {
    let set = |list: &[&[u8]]| {
        list.iter()
            .map(|v| Bad::Set(v.to_vec()))
            .collect::<Vec<_>>()
    };
    let required = |mut v: Vec<Bad>| {
        v.push(Bad::Delete);
        v
    };
    match field {
        "exp" | "created" | "committed" | "reserved" | "open" | "fa" => required(set(NOT_INTEGERS)),
        // A lease or a window is 1 ms to 7 days.
        "lease" | "gwin" => {
            let mut v = set(NOT_INTEGERS);
            v.extend(set(&[b"0", b"604800001"]));
            required(v)
        }
        // Absent: unlimited; no call yet.
        "budget" | "n:" => set(NOT_INTEGERS),
        // "" is no cap; absent, not in scope.
        "t:" => set(&NOT_INTEGERS[..NOT_INTEGERS.len() - 2]),
        "status" => required(set(&[b"0", b"3", b"1.0", b"x", b""])),
        "gmode" => required(set(&[b"3", b"-1", b"x", b"1.0", b""])),
        // Absent: count; not closed.
        "upol" => set(&[b"0", b"2", b"x", b""]),
        "closed" => set(&[b"0", b"x", b""]),
        // Absent: no approval rule.
        "appr" => set(&[b"0", b"2", b"x", b""]),
        // "<cost_at_least>:<wait>:<approvers>", wait 1 ms to 7 days.
        "ap:" => set(&[
            b"",
            b"x",
            b"1:1",
            b"1:0:1",
            b"1:1:3",
            b"01:1:1",
            b"-1:1:1",
            b":604800001:1",
            b"1:1:1:1",
        ]),
        "subject" | "currency" => required(set(&[b"\xff"])),
        // t\nv: a tool without its t: field.
        "tools" => required(set(&[b"\xff", b"", b"t\n\nu", b"t\nv", b"t u"])),
        other => panic!("no values for field {other}"),
    }
}

fn element_values(i: usize) -> Vec<M> {
    let mut v = vec![M::Nil, M::Bool(true), M::Arr(Vec::new())];
    v.extend(match i {
        // id
        1 => vec![M::Int(7), s(b""), s(&[1; 15]), s(&[1; 17])],
        // tool
        2 => vec![M::Int(1), s(b""), s(b"t u"), s(b"\xff")],
        // fingerprint
        3 => vec![M::Int(1)],
        // cost
        4 => vec![
            s(b"1"),
            M::F64(1.5),
            M::F64(1.0),
            M::Int(-1),
            M::Int(atmost::domain::MAX_AMOUNT + 1),
        ],
        // state (8, APPROVED, the last this version knows)
        5 => vec![M::Int(0), M::Int(9), s(b"1"), M::F64(1.0)],
        // lease - created
        6 => vec![
            M::Int(-1),
            M::Int(0),
            s(b"30000"),
            M::F64(30_000.5),
            M::Int(atmost::domain::MAX_DURATION_MS + 1),
        ],
        // receipt id
        7 => vec![M::Int(1), s(&[1; 5])],
        // result
        8 => vec![M::Int(1)],
        // actual cost: at most the cost (1)
        9 => vec![s(b"0"), M::F64(0.5), M::Int(-1), M::Int(2)],
        // failure, uncertain reason: UTF-8 text
        10 | 11 => vec![M::Int(1), s(b"\xff")],
        // dup_of: "" or a key
        12 => vec![M::Int(1), s(b"\x01"), s(b"\xff"), s(&[b'k'; 256])],
        // holder token
        13 => vec![M::Int(1)],
        // uncertain since: at most the lease
        14 => vec![
            s(b"0"),
            M::F64(0.5),
            M::Int(-1),
            M::Int(999_999_999_999_999),
        ],
        // by: "" or a key id
        15 => vec![M::Int(1), s(b"\xff"), s(b"a b")],
        // the approval (for k3, each of its fields too: approval_values)
        16 => vec![s(b""), M::Int(0)],
        // one more element than atmost writes
        17 => vec![s(b""), M::Int(0)],
        _ => unreachable!(),
    });
    v
}

/// Each field of an approval (lib.lua: read_approval), corrupted: the
/// field's index (0-based) and its value; past the fields, one more.
/// Each is not what atmost writes whatever the call's state.
fn approval_values() -> Vec<(usize, M)> {
    let common = || vec![M::Nil, M::Bool(true)];
    let mut v = Vec::new();
    let mut field = |i: usize, bad: Vec<M>| {
        v.extend(common().into_iter().chain(bad).map(|m| (i, m)));
    };
    // summary: UTF-8 text of at most 1024 bytes
    field(
        0,
        vec![M::Int(1), s(b"\xff"), s(&[b'a'; 1025]), M::Arr(Vec::new())],
    );
    // expires: a time after the call's creation
    field(1, vec![s(b"1"), M::F64(1.5), M::Int(-1), M::Int(0)]);
    // approvers needed: 1 or 2
    field(2, vec![M::Int(0), M::Int(3), s(b"1"), M::F64(1.0)]);
    // approved_by: key ids ("" in dev mode), at most the number needed
    field(
        3,
        vec![
            M::Int(1),
            s(b""),
            M::Arr(vec![M::Int(1)]),
            M::Arr(vec![s(b"a b")]),
            M::Arr(vec![s(b"x"), s(b"y"), s(b"z")]),
        ],
    );
    // decided_by: "" or a key id
    field(4, vec![M::Int(1), s(b"a b"), s(b"\xff")]);
    // decided_at: a whole number
    field(5, vec![s(b"0"), M::F64(0.5), M::Int(-1)]);
    // denial reason: UTF-8, and only once DENIED
    field(6, vec![M::Int(1), s(b"\xff"), s(b"no")]);
    // one more field than atmost writes
    field(7, vec![s(b""), M::Int(0)]);
    v
}

/// What each of [`record_values`] is.
const SHAPES: [&str; 9] = [
    "not msgpack",
    "cut short",
    "a second object after it",
    "a map",
    "the cost as a u16",
    "the id as bin",
    "a string",
    "five elements",
    "empty",
];

/// k1's record as a whole, in shapes save_attempt never writes.
fn record_values(raw: &[u8]) -> Vec<Vec<u8>> {
    let items = elements(raw);
    let mut map = Vec::new();
    rmp::encode::write_map_len(&mut map, items.len() as u32).expect("pack");
    for (i, item) in items.iter().enumerate() {
        pack(&M::Int(i as i64 + 1), &mut map);
        pack(item, &mut map);
    }
    let mut wide = Vec::new();
    rmp::encode::write_array_len(&mut wide, items.len() as u32).expect("pack");
    for (i, item) in items.iter().enumerate() {
        match (i, item) {
            // The cost, 1, as a u16.
            (3, M::Int(n)) => rmp::encode::write_u16(&mut wide, *n as u16).expect("pack"),
            _ => pack(item, &mut wide),
        }
    }
    let mut bin = Vec::new();
    rmp::encode::write_array_len(&mut bin, items.len() as u32).expect("pack");
    for (i, item) in items.iter().enumerate() {
        match (i, item) {
            // The id as msgpack bin, not str.
            (0, M::Str(b)) => {
                rmp::encode::write_bin(&mut bin, b).expect("pack");
            }
            _ => pack(item, &mut bin),
        }
    }
    vec![
        b"\xc1".to_vec(),
        raw[..raw.len() / 2].to_vec(),
        [raw, &[0]].concat(),
        map,
        wide,
        bin,
        packed(&s(b"x")),
        packed(&M::Arr(items[..5].to_vec())),
        Vec::new(),
    ]
}

/// Members in the range a script reads (at or before `now`) that name no
/// open attempt there, or are not the shape atmost writes.
fn member_values(scenario: Scenario, target: Target, vals: Vals) -> Vec<Bad> {
    let at = match target {
        // In the range a lapse reads, at or before `now`.
        PendingMember => k3_deadline(scenario).min(OP) - 1,
        AwaitingMember => SETUP - 1,
        _ => k1_at(scenario).min(OP) - 1,
    };
    let prefix = if target == HeldMember { "t\n" } else { "" };
    let shapes = vec![
        format!("{prefix}{at:015}"),
        format!("{prefix}{at:015}:"),
        format!("{prefix}{}:k1", &format!("{at:015}")[..13]),
        format!("{prefix}{at:015}k1"),
    ];
    let members = match vals {
        Vals::Shapes => shapes,
        Vals::OutOfRange => vec![format!("{prefix}x")],
        _ => {
            let mut v = vec![member(target, at, "kzz"), member(target, at, "k1")];
            v.extend(shapes);
            v
        }
    };
    members.into_iter().map(Bad::Member).collect()
}

fn values(scenario: Scenario, target: Target, vals: Vals) -> Vec<Bad> {
    match vals {
        Vals::Set(list) => return list.iter().map(|v| Bad::Set(v.to_vec())).collect(),
        Vals::Delete => return vec![Bad::Delete],
        Vals::Dangling => return vec![Bad::Set(b"kzz".to_vec())],
        Vals::AddMember(m) => return vec![Bad::Add(m.to_owned(), 0)],
        Vals::OwnMember => return vec![Bad::Own(5)],
        Vals::Kind | Vals::Shapes | Vals::OutOfRange => {}
    }
    match target {
        Field(f) => field_values(f),
        Element(i) => {
            let mut v: Vec<Bad> = element_values(i)
                .into_iter()
                .map(|m| Bad::Element(i, m))
                .collect();
            if i == 16 && scenario.subject() == "k3" {
                v.extend(
                    approval_values()
                        .into_iter()
                        .map(|(i, m)| Bad::ApprovalField(i, m)),
                );
            }
            v
        }
        Record => (0..SHAPES.len()).map(Bad::Shape).collect(),
        DupPointer => [&b"\x01"[..], b"", b"\xff", &[b'k'; 256]]
            .iter()
            .map(|v| Bad::Set(v.to_vec()))
            .collect(),
        OpenMember | HeldMember | PendingMember | AwaitingMember => {
            member_values(scenario, target, vals)
        }
        // Members not of the shape atmost writes, before k3's.
        ApprovalsMember => {
            let at = SETUP - 1;
            [
                format!("{at:015}"),
                format!("{at:015}:"),
                format!("{}:p:k3", &format!("{at:015}")[..13]),
                format!("{at:015}:not-36-characters:k3"),
            ]
            .into_iter()
            .map(|m| Bad::Add(m, 0))
            .collect()
        }
        IndexMember | TenantMember => {
            unreachable!("index members are added, with their values")
        }
        // Members not of the shape atmost writes, before k1's (the census
        // reads only the first one's time: one whose permit part is not a
        // permit id still counts, as uncertain).
        UncertainMember => {
            let at = MARK - 1;
            let mut shapes = vec![
                format!("{at:015}"),
                format!("{at:015}:"),
                format!("{}:p:k1", &format!("{at:015}")[..13]),
            ];
            if scenario == ListIndex {
                shapes.push(format!("{at:015}:not-36-characters:k1"));
            }
            shapes.into_iter().map(|m| Bad::Add(m, 0)).collect()
        }
        CensusField(_) => NOT_INTEGERS.iter().map(|v| Bad::Set(v.to_vec())).collect(),
        KeyType(_) => vec![Bad::Type],
    }
}

/// The subject's record ([`Scenario::subject`]: k1's, or k3's).
async fn k1_record(ctx: &Ctx, conn: &mut MultiplexedConnection) -> Vec<u8> {
    redis::cmd("HGET")
        .arg(ctx.key("attempts"))
        .arg(ctx.scenario.subject())
        .query_async(conn)
        .await
        .expect("the subject's record")
}

/// The guard's field for tool t and k1's fingerprint (lib.lua: dup_field).
async fn dup_field(conn: &mut MultiplexedConnection) -> String {
    redis::cmd("EVAL")
        .arg("return string.sub(redis.sha1hex(ARGV[1]), 1, 12)")
        .arg(0)
        .arg("t\nfp")
        .query_async(conn)
        .await
        .expect("dup field")
}

async fn apply(ctx: &Ctx, conn: &mut MultiplexedConnection, target: Target, bad: &Bad) {
    let field = |f: &str| match f {
        "t:" | "n:" | "ap:" => format!("{f}{}", ctx.scenario.tool()),
        f => f.to_owned(),
    };
    let mut cmds = Vec::new();
    match (target, bad) {
        (Field(f), Bad::Set(v)) => {
            cmds.push(
                redis::cmd("HSET")
                    .arg(ctx.key("permit"))
                    .arg(field(f))
                    .arg(v)
                    .clone(),
            );
        }
        (Field(f), Bad::Delete) => {
            cmds.push(
                redis::cmd("HDEL")
                    .arg(ctx.key("permit"))
                    .arg(field(f))
                    .clone(),
            );
        }
        (DupPointer, Bad::Set(v)) => {
            let f = dup_field(conn).await;
            cmds.push(redis::cmd("HSET").arg(ctx.key("dup")).arg(f).arg(v).clone());
        }
        (DupPointer, Bad::Delete) => {
            let f = dup_field(conn).await;
            cmds.push(redis::cmd("HDEL").arg(ctx.key("dup")).arg(f).clone());
        }
        (Element(_), Bad::Element(i, m)) => {
            let mut items = elements(&k1_record(ctx, conn).await);
            while items.len() < *i {
                items.push(empty_element(items.len() + 1));
            }
            items[i - 1] = m.clone();
            let raw = packed(&M::Arr(items));
            cmds.push(
                redis::cmd("HSET")
                    .arg(ctx.key("attempts"))
                    .arg(ctx.scenario.subject())
                    .arg(raw)
                    .clone(),
            );
        }
        (Element(_), Bad::ApprovalField(i, m)) => {
            let mut items = elements(&k1_record(ctx, conn).await);
            let M::Arr(approval) = &mut items[15] else {
                panic!("the subject has no approval: {items:?}");
            };
            if *i < approval.len() {
                approval[*i] = m.clone();
            } else {
                approval.push(m.clone());
            }
            let raw = packed(&M::Arr(items));
            cmds.push(
                redis::cmd("HSET")
                    .arg(ctx.key("attempts"))
                    .arg(ctx.scenario.subject())
                    .arg(raw)
                    .clone(),
            );
        }
        (Record, Bad::Shape(i)) => {
            let raw = record_values(&k1_record(ctx, conn).await).swap_remove(*i);
            cmds.push(
                redis::cmd("HSET")
                    .arg(ctx.key("attempts"))
                    .arg(ctx.scenario.subject())
                    .arg(raw)
                    .clone(),
            );
        }
        (PendingMember | AwaitingMember, bad) => {
            let set = ctx.key(if target == PendingMember {
                "pending"
            } else {
                "awaiting"
            });
            let own = k3_member(ctx.scenario, target);
            cmds.push(redis::cmd("ZREM").arg(&set).arg(&own).clone());
            match bad {
                Bad::Member(m) => cmds.push(redis::cmd("ZADD").arg(&set).arg(0).arg(m).clone()),
                Bad::Delete => {}
                other => panic!("{other:?} for a member"),
            }
        }
        (ApprovalsMember, Bad::Add(m, score)) => {
            cmds.push(
                redis::cmd("ZADD")
                    .arg(ctx.key("approvals_t"))
                    .arg(score)
                    .arg(m)
                    .clone(),
            );
        }
        (OpenMember | HeldMember, bad) => {
            let set = ctx.key(if target == HeldMember { "held" } else { "open" });
            let own = member(target, ctx.k1_at, "k1");
            cmds.push(redis::cmd("ZREM").arg(&set).arg(&own).clone());
            match bad {
                Bad::Member(m) => cmds.push(redis::cmd("ZADD").arg(&set).arg(0).arg(m).clone()),
                Bad::Delete => {}
                other => panic!("{other:?} for a member"),
            }
        }
        (IndexMember, Bad::Add(m, score)) => {
            cmds.push(
                redis::cmd("ZADD")
                    .arg(ctx.key("index"))
                    .arg(score)
                    .arg(m)
                    .clone(),
            );
        }
        (UncertainMember, Bad::Add(m, score)) => {
            // ListUncertain reads the tenant's shard; the census, the fleet's.
            let shard = if matches!(ctx.scenario, ListIndex | ListAttempts) {
                "uncertain_t"
            } else {
                "uncertain"
            };
            cmds.push(
                redis::cmd("ZADD")
                    .arg(ctx.key(shard))
                    .arg(score)
                    .arg(m)
                    .clone(),
            );
        }
        (CensusField(f), Bad::Set(v)) => {
            cmds.push(
                redis::cmd("HSET")
                    .arg(ctx.key("census"))
                    .arg(f)
                    .arg(v)
                    .clone(),
            );
        }
        (TenantMember, Bad::Add(m, score)) => {
            cmds.push(
                redis::cmd("ZADD")
                    .arg(ctx.key("tenants"))
                    .arg(score)
                    .arg(m)
                    .clone(),
            );
        }
        (IndexMember, Bad::Own(score)) => {
            let m = index_member(&ctx.permit_id);
            cmds.push(
                redis::cmd("ZADD")
                    .arg(ctx.key("index"))
                    .arg(score)
                    .arg(m)
                    .clone(),
            );
        }
        (KeyType(k), Bad::Type) => {
            cmds.push(redis::cmd("DEL").arg(ctx.key(k)).clone());
            cmds.push(
                redis::cmd("SET")
                    .arg(ctx.key(k))
                    .arg("not a hash or a set")
                    .clone(),
            );
        }
        other => panic!("no way to apply {other:?}"),
    }
    for cmd in cmds {
        let _: redis::Value = cmd.query_async(conn).await.expect("corrupt");
    }
}

// === the snapshot ===

/// Every key under the case's prefix: its DUMP and its PEXPIRETIME, read
/// in one script run.
async fn snapshot(
    conn: &mut MultiplexedConnection,
    prefix: &str,
) -> BTreeMap<String, (Vec<u8>, i64)> {
    let flat: Vec<redis::Value> = redis::cmd("EVAL")
        .arg(
            "local out = {} \
             for _, k in ipairs(redis.call('KEYS', ARGV[1])) do \
               out[#out + 1] = k \
               out[#out + 1] = redis.call('DUMP', k) \
               out[#out + 1] = redis.call('PEXPIRETIME', k) \
             end \
             return out",
        )
        .arg(0)
        .arg(format!("{prefix}:*"))
        .query_async(conn)
        .await
        .expect("snapshot");
    flat.chunks(3)
        .map(|c| match c {
            [
                redis::Value::BulkString(k),
                redis::Value::BulkString(dump),
                redis::Value::Int(at),
            ] => (String::from_utf8_lossy(k).into_owned(), (dump.clone(), *at)),
            other => panic!("snapshot: {other:?}"),
        })
        .collect()
}

fn changed(
    before: &BTreeMap<String, (Vec<u8>, i64)>,
    after: &BTreeMap<String, (Vec<u8>, i64)>,
) -> Vec<String> {
    let keys: BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    keys.into_iter()
        .filter(|k| before.get(*k) != after.get(*k))
        .map(|k| k.rsplit(':').next().unwrap_or(k).to_owned())
        .collect()
}

fn shown(r: &Result<String, Error>) -> String {
    match r {
        Ok(answer) => answer.clone(),
        Err(Error::StoreUnavailable(why)) => format!("STORE_UNAVAILABLE ({why})"),
        Err(e) => e.reason().as_str().to_owned(),
    }
}

// === the tests ===

/// Each case of [`table`]: the state built, one value corrupted, every key
/// read, the call made, every key read again. Failures are collected, so
/// one run names every case that does not hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_script_validates_all_it_reads_before_its_first_write() {
    let _machine = shared().await;
    let redis = Redis::start();
    let mut conn = redis.connect().await;
    let mut n = 0;
    let mut failures = Vec::new();

    // Each scenario untouched: its normal answer, and a write where it
    // writes (so each case below is one in which the script would write).
    for scenario in Scenario::ALL {
        n += 1;
        let ctx = build(&redis, n, scenario, &mut conn).await;
        if ELEMENT_SCENARIOS.contains(&scenario) {
            let raw = k1_record(&ctx, &mut conn).await;
            assert_eq!(
                packed(&unpack(&mut &raw[..])),
                raw,
                "{scenario:?}: the test packs k1's record as cmsgpack does"
            );
            // k3's has its approval besides.
            let full = if scenario.subject() == "k3" { 16 } else { 15 };
            assert_eq!(elements(&raw).len(), full, "{scenario:?}: a full record");
        }
        let before = snapshot(&mut conn, &ctx.prefix).await;
        let answer = shown(&call(&ctx, scenario, &mut conn).await);
        let after = snapshot(&mut conn, &ctx.prefix).await;
        assert_eq!(answer, scenario.normal(), "{scenario:?} uncorrupted");
        assert_eq!(
            !changed(&before, &after).is_empty(),
            scenario.writes(),
            "{scenario:?} uncorrupted: writes"
        );
    }

    let mut cases = 0;
    let mut summary: BTreeMap<String, usize> = BTreeMap::new();
    for (scenario, target, vals, expect) in table() {
        for bad in values(scenario, target, vals) {
            cases += 1;
            n += 1;
            let ctx = build(&redis, n, scenario, &mut conn).await;
            apply(&ctx, &mut conn, target, &bad).await;
            let before = snapshot(&mut conn, &ctx.prefix).await;
            let result = call(&ctx, scenario, &mut conn).await;
            let after = snapshot(&mut conn, &ctx.prefix).await;
            let wrote = changed(&before, &after);
            let answer = shown(&result);
            let fail = match expect {
                Unavailable => {
                    !matches!(result, Err(Error::StoreUnavailable(_))) || !wrote.is_empty()
                }
                Unchanged(want) => answer != want || !wrote.is_empty(),
                Writes(want) => answer != want,
            };
            if fail {
                let what = match target {
                    Element(_) => "Element".to_owned(),
                    t => format!("{t:?}"),
                };
                *summary
                    .entry(format!("{} {what}", scenario.script()))
                    .or_default() += 1;
                failures.push(format!(
                    "{} {scenario:?} {target:?} {bad:?}: answered {answer}, wrote {wrote:?} \
                     (expected {expect:?})",
                    scenario.script()
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {cases} cases failed:\n{}\nby script and target: {summary:#?}",
        failures.len(),
        failures.join("\n")
    );
}

// --- the table against the scripts' sources

fn lua(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src/store/redis/lua")
        .join(format!("{name}.lua"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Lua without its comments (none of atmost's strings holds "--").
fn code(src: &str) -> String {
    src.lines()
        .map(|l| l.find("--").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The text of each `name(...)` call's arguments in `code`.
fn calls<'a>(code: &'a str, name: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = code[from..].find(name) {
        let start = from + i;
        from = start + name.len();
        let before = code[..start].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.') {
            continue;
        }
        let rest = &code[from..];
        if !rest.starts_with('(') {
            continue;
        }
        let mut depth = 0;
        for (j, c) in rest.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        out.push(&rest[1..j]);
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// The quoted strings of a Lua text.
fn quoted(text: &str) -> Vec<&str> {
    text.split('\'').skip(1).step_by(2).collect()
}

/// The functions of lib.lua, by name, with their code.
fn lib_functions() -> BTreeMap<String, String> {
    let lib = code(&lua("lib"));
    let mut out = BTreeMap::new();
    let parts: Vec<&str> = lib.split("local function ").skip(1).collect();
    for part in parts {
        let name: String = part
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        out.insert(name, part.to_owned());
    }
    out
}

/// A script's KEYS, by index, from its header (`KEYS[3]  <prefix>:{P}:open`),
/// under lib.lua's names; those marked "(unused)" left out.
fn header_keys(src: &str) -> BTreeMap<usize, String> {
    let mut out = BTreeMap::new();
    for line in src.lines().filter(|l| l.starts_with("--")) {
        for part in line.split("KEYS[").skip(1) {
            let (n, rest) = part.split_once(']').expect("KEYS[n]");
            let token = rest.split_whitespace().next().expect("a key after KEYS[n]");
            if rest.contains("(unused)") {
                continue;
            }
            let name = if token.contains(":permits") {
                "index".to_owned()
            } else if token.contains(":uncertain:") {
                if token.contains(":t:") {
                    "uncertain_t".to_owned()
                } else {
                    "uncertain".to_owned()
                }
            } else if token.contains(":census:") {
                "census".to_owned()
            } else if token.contains(":approvals:") {
                "approvals_t".to_owned()
            } else {
                token.rsplit(':').next().expect("a key name").to_owned()
            };
            out.insert(n.parse().expect("a key index"), name);
        }
    }
    out
}

/// What a script reads, from its source and the lib.lua functions it
/// calls: permit fields (HMGET, and the helpers that read fields by name;
/// HGETALL: all of them), attempt records (load_attempt), the guard's
/// pointer, set members, and the keys its header names.
fn reads(script: &str) -> BTreeSet<Target> {
    let src = lua(script);
    let lib = lib_functions();
    let keys = header_keys(&src);
    // The script's code and that of every lib function it reaches.
    let mut texts = vec![code(&src)];
    let mut seen = BTreeSet::new();
    let mut i = 0;
    while i < texts.len() {
        for (name, body) in &lib {
            if !seen.contains(name) && !calls(&texts[i], name).is_empty() {
                seen.insert(name.clone());
                texts.push(body.clone());
            }
        }
        i += 1;
    }
    let mut out: BTreeSet<Target> = keys.values().map(|k| KeyType(leak(k))).collect();
    for text in &texts {
        for call in calls(text, "redis.call")
            .into_iter()
            .chain(calls(text, "redis.pcall"))
        {
            let words = quoted(call);
            let Some(cmd) = words.first() else { continue };
            // KEYS[n] / keys[n] after the command: the key it reads.
            let key = call
                .split(['[', ']'])
                .nth(1)
                .and_then(|n| n.parse::<usize>().ok())
                .and_then(|n| keys.get(&n));
            if *cmd == "HMGET" {
                let census = key.is_some_and(|k| k == "census");
                out.extend(words[1..].iter().map(|f| {
                    if census {
                        CensusField(leak(f))
                    } else {
                        Field(leak(f))
                    }
                }));
            }
            if *cmd == "HGETALL" {
                out.extend(ALL_FIELDS.iter().map(|f| Field(f)));
            }
            let read = matches!(
                *cmd,
                "ZSCORE" | "ZRANGEBYLEX" | "ZRANGE" | "ZLEXCOUNT" | "ZCARD" | "HGET"
            );
            match (key.map(String::as_str), read) {
                (Some("dup"), true) => {
                    out.insert(DupPointer);
                }
                (Some("open"), true) => {
                    out.insert(OpenMember);
                }
                (Some("held"), true) => {
                    out.insert(HeldMember);
                }
                (Some("index"), true) => {
                    out.insert(IndexMember);
                }
                (Some("tenants"), true) => {
                    out.insert(TenantMember);
                }
                (Some("uncertain" | "uncertain_t"), true) => {
                    out.insert(UncertainMember);
                }
                (Some("pending"), true) => {
                    out.insert(PendingMember);
                }
                (Some("awaiting"), true) => {
                    out.insert(AwaitingMember);
                }
                (Some("approvals_t"), true) => {
                    out.insert(ApprovalsMember);
                }
                _ => {}
            }
        }
        // The helpers that read permit fields by name: the quoted names
        // they are given (their own HMGET is read above).
        for helper in ["read_permit", "permit_for"] {
            for call in calls(text, helper) {
                out.extend(quoted(call).into_iter().map(|f| Field(leak(f))));
            }
        }
        if !calls(text, "load_attempt").is_empty() {
            out.insert(Record);
            out.extend((1..=ELEMENTS).map(Element));
        }
    }
    out
}

fn leak(s: &str) -> &'static str {
    match ALL_FIELDS.iter().find(|f| **f == s) {
        Some(f) => f,
        None => Box::leak(s.to_owned().into_boxed_str()),
    }
}

/// The table is complete: every script has a scenario, and every value a
/// script reads (by its source) has a case in one of its scenarios; and no
/// case names a permit field its script does not read.
#[test]
fn the_table_lists_every_read() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/store/redis/lua");
    let mut scripts: Vec<String> = std::fs::read_dir(&dir)
        .expect("the scripts")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".lua").map(str::to_owned))
        .filter(|n| n != "lib")
        .collect();
    scripts.sort();
    let rows = table();
    let mut missing = Vec::new();
    for script in &scripts {
        let listed: BTreeSet<Target> = rows
            .iter()
            .filter(|(s, ..)| s.script() == script)
            .map(|(_, t, ..)| *t)
            .collect();
        assert!(
            Scenario::ALL.iter().any(|s| s.script() == script),
            "{script}.lua has no scenario"
        );
        let read = reads(script);
        for target in &read {
            if !listed.contains(target) {
                missing.push(format!("{script}: {target:?} is read but has no case"));
            }
        }
        for target in &listed {
            if matches!(target, Field(_)) && !read.contains(target) {
                missing.push(format!("{script}: {target:?} has a case but is not read"));
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
