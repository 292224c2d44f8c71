"""Every message op, header field and command of geomx's protocol, named once.

A message (geomx.transport.message) is ``op`` + ``fields`` (a msgpack map) + tensors. Modules compare and
build ops, commands and fields through these names, never through string literals, so that a new op or
field is added here and found everywhere by its name. The wire values are the strings below (they are the
protocol: changing one breaks compatibility with running nodes).

Control (a node and its tier's scheduler; every control message carries ``tier``, a scheduler's also
``auth``):

==================  =========================  =============================================================
op                  direction                  fields
==================  =========================  =============================================================
``register``        node -> scheduler          tier_role, kind, dc, addr, rank, declared, pid, hostname, token
``table``           scheduler -> members       members (id, kind, tier_role, dc, rank, addr, pid each)
``reject``          scheduler -> node          reason
``barrier``         node -> scheduler          group, seq
``barrier_done``    scheduler -> members       seq
``hb`` / ``hb_ack``  node <-> scheduler         (none)
``bye``             node -> scheduler          (none): leaving cleanly
``shutdown``        scheduler -> servers       (none): every worker left
``member_left``     scheduler -> members       node, reason: the tier goes on without a member (a DC's worker, a DC)
``member_joined``   scheduler -> members       member (its table entry), replaces: it took a dropped member's place
``abort``           any -> any                 reason; fatal (a tier failed before it was complete)
==================  =========================  =============================================================

Data (a client and a server; requests carry ``req``, the reply echoes it):

==================  =========================  =============================================================
``init``            client -> server           key; master (with the value) or layout [shape, dtype]
``push``            client -> server           key, the gradient (maybe compressed: cm, n); checkpoint_round
``pull``            client -> server           key, after (the client's pushes it must reflect)
``pushpull``        client -> server           key, gradient: push and pull in one message; checkpoint_round
``dc_pushpull``     worker -> local server     key, value: a DC-only round (HFA)
``cmd``             master -> global servers   name (a Command), args
``key_owner``       master -> global servers   key, owner (the rank that holds the key)
``checkpoint_at``   global server 0 -> others  round: checkpoint every key as of that round (checkpoint_clock.py)
``reply``           server -> client           req; error, lost; info; redirect; joined_at, digest;
                                               checkpoint_round; the value
==================  =========================  =============================================================
"""
from __future__ import annotations


class Op:
    # control
    REGISTER = "register"
    TABLE = "table"
    REJECT = "reject"
    BARRIER = "barrier"
    BARRIER_DONE = "barrier_done"
    HEARTBEAT = "hb"
    HEARTBEAT_ACK = "hb_ack"
    BYE = "bye"
    SHUTDOWN = "shutdown"
    MEMBER_LEFT = "member_left"
    MEMBER_JOINED = "member_joined"
    ABORT = "abort"
    # data
    INIT = "init"
    PUSH = "push"
    PULL = "pull"
    PUSHPULL = "pushpull"
    DC_PUSHPULL = "dc_pushpull"
    COMMAND = "cmd"
    KEY_OWNER = "key_owner"
    CHECKPOINT_AT = "checkpoint_at"
    REPLY = "reply"


CONTROL_OPS = frozenset({Op.REGISTER, Op.TABLE, Op.REJECT, Op.BARRIER, Op.BARRIER_DONE, Op.HEARTBEAT,
                         Op.HEARTBEAT_ACK, Op.BYE, Op.SHUTDOWN, Op.MEMBER_LEFT, Op.MEMBER_JOINED,
                         Op.ABORT})


class Field:
    # control
    TIER = "tier"
    TIER_ROLE = "tier_role"
    KIND = "kind"
    DC = "dc"
    ADDR = "addr"
    RANK = "rank"
    ORDER = "order"         # where a member that asks for no rank would like to come among its DC's (registration)
    DECLARED = "declared"
    PID = "pid"
    HOSTNAME = "hostname"
    MEMBERS = "members"
    REASON = "reason"
    NODE = "node"
    MEMBER = "member"
    REPLACES = "replaces"
    FATAL = "fatal"       # abort: a tier failed before it was complete (no fault domain absorbs it)
    RELAYED = "relayed"   # abort: passed on from another role's abort, or from a lost peer: not where it began
    FINISHED = "finished"  # member_left: the member finished its training and said goodbye (not a fault)
    GROUP = "group"
    SEQ = "seq"
    TOKEN = "token"       # register: a secret the member chose; its scheduler echoes it as AUTH in every answer
    AUTH = "auth"
    # data
    REQ = "req"
    KEY = "key"
    MASTER = "master"
    LAYOUT = "layout"
    AFTER = "after"
    NAME = "name"
    ARGS = "args"
    OWNER = "owner"
    ERROR = "error"
    LOST = "lost"
    INFO = "info"
    REDIRECT = "redirect"
    JOINED_AT = "joined_at"   # init reply to a member that rejoined a running job: the rounds it takes no part in
    DIGEST = "digest"         # ... and the digest of the value it starts from (geomx.cluster.digest)
    CODEC = "cm"          # compressed payload: {"c": codec name, "m": codec meta, "n": sender count}
    COUNT = "n"           # a dense push of a mean: how many workers' sum it stands for
    ROUND = "round"       # checkpoint_at: the round every key is checkpointed as of
    CHECKPOINT_ROUND = "checkpoint_round"   # a value reply, a push: the latest round the global servers checkpoint at


class Command:
    """``cmd`` names: the master worker configures the global servers; workers meet across DCs."""
    SET_MODE = "set_mode"
    SET_OPTIMIZER = "set_optimizer"
    SET_COMPRESSION = "set_compression"
    GLOBAL_BARRIER = "global_barrier"


def is_round(value) -> bool:
    """A round number as a message may carry it (``round``, ``checkpoint_round``): a whole number >= 1, not a
    bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
