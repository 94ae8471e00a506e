"""The lock table and every statement on it: no connection here.

One table holds every lock, liveness record, fencing counter and plain cache
item of a ``PostgresCache`` alias: a row per store key, its value as text and
when it expires, by the server's clock (``clock_timestamp()``; never a
client's). A row past its expiry is as good as absent: every statement reads
and takes it as such, and ``SWEEP`` removes such rows in batches.

Each statement is one atomic step in autocommit: a take is an ``INSERT ... ON
CONFLICT ... DO UPDATE ... WHERE`` the row expired (its row lock held for that
statement only); a release, an extend and a replace act only ``WHERE`` the
stored value is the holder's token. A release keeps the row and moves its
expiry into the past: no indexed column changes, so the next take of the key
is a HOT update on the same page (the fillfactor leaves it room), which the
page prunes by itself, without waiting for autovacuum. A fence is its lock's
counter plus one, drawn in the statement that checks the lock is still the
holder's.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CREATE",
    "DROP",
    "TABLE",
    "Row",
    "array",
    "seconds",
]

TABLE: Final = "django_tasklock_item"
#: A row of a statement's reply: its columns as text (None: NULL).
Row = tuple["str | None", ...]

#: The row of the table that records the database's run (``runs``).
RUN_KEY: Final = "django_tasklock:run"
#: The server's identity: its system identifier and current timeline.
SERVER_RUN: Final = (
    "system_identifier::text || ':' || "
    "substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)"
)
#: Whether its commits wait for a standby's flush: 's', else 'a'.
REPLICATION: Final = """CASE WHEN current_setting('synchronous_standby_names') <> ''
    AND current_setting('synchronous_commit') IN ('on', 'remote_write', 'remote_apply')
    THEN 's' ELSE 'a' END"""

#: The table, made by the app's migration, with the record of the run it was
#: made on (so that a record gone later is known gone: ``runs``). ``pickled``:
#: a value Django's cache API stored pickled (base64), not text. A fillfactor
#: below 100 leaves room for the new row version of an update on the same
#: page (a HOT update: no index touched, no bloat of the primary key).
CREATE: Final = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    key text PRIMARY KEY,
    value text NOT NULL,
    pickled boolean NOT NULL DEFAULT false,
    expires timestamptz NOT NULL
) WITH (fillfactor = 70);
INSERT INTO {TABLE} (key, value, expires)
SELECT '{RUN_KEY}', {SERVER_RUN} || ':0:' || {REPLICATION}, 'infinity'
FROM pg_control_system()
ON CONFLICT (key) DO NOTHING;
"""
DROP: Final = f"DROP TABLE IF EXISTS {TABLE};"

_NOW = "clock_timestamp()"
#: $3 seconds from now; NULL: never.
_UNTIL = f"COALESCE({_NOW} + $3::float8 * interval '1 second', 'infinity')"
_LIVE = f"t.expires > {_NOW}"

#: $1 key, $2 token, $3 seconds: the lock taken if absent or expired (or
#: already this token's: a take sent again after its reply was lost).
TAKE: Final = f"""
INSERT INTO {TABLE} AS t (key, value, expires) VALUES ($1, $2, {_UNTIL})
ON CONFLICT (key) DO UPDATE
SET value = excluded.value, pickled = false, expires = excluded.expires
WHERE t.expires <= {_NOW} OR (t.value = excluded.value AND NOT t.pickled)
RETURNING 1""".encode()

#: $1 key, $2 token, $3 seconds, $4 the value it may take the place of.
TAKE_OVER: Final = f"""
INSERT INTO {TABLE} AS t (key, value, expires) VALUES ($1, $2, {_UNTIL})
ON CONFLICT (key) DO UPDATE
SET value = excluded.value, pickled = false, expires = excluded.expires
WHERE t.expires <= {_NOW} OR (t.value = $4 AND NOT t.pickled)
RETURNING 1""".encode()

#: The server's run, read from shared memory (no file, no table): its
#: timeline and when its postmaster started. Any change (a promotion, a
#: restart, another server behind a pooler's same connection) has the
#: connection learn the run again (``runs``), which then judges it.
RUN_MARK: Final = (
    "substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) || ':' || "
    "extract(epoch FROM pg_postmaster_start_time())::text"
)
#: The server's run mark alone (``RUN_MARK``).
READ_RUN_MARK: Final = f"SELECT {RUN_MARK}".encode()


def _on_run(take: bytes, mark: str) -> bytes:
    """``take`` made only on the run whose mark is the parameter ``mark``:
    one row, whether it took (1 or 0) and the server's run mark."""
    values = f"VALUES ($1, $2, {_UNTIL})"
    statement = take.decode()
    assert values in statement
    only_here = f"SELECT $1, $2, {_UNTIL} FROM here WHERE here.run = {mark}"
    return (
        f"WITH here AS (SELECT {RUN_MARK} AS run), took AS ("
        f"{statement.replace(values, only_here)}) "
        "SELECT (SELECT count(*) FROM took), here.run FROM here"
    ).encode()


#: TAKE and TAKE_OVER, each on the run the connection knows (a pooler may
#: send its connection to another server): $4 (TAKE_OVER: $5) the run mark.
TAKE_ON_RUN: Final = _on_run(TAKE, "$4")
TAKE_OVER_ON_RUN: Final = _on_run(TAKE_OVER, "$5")

#: The channel a release's wake-up is sent on (``NOTIFY``), its payload
#: the md5 of the lock's key (``line``).
CHANNEL: Final = "django_tasklock"
#: What a lock's key takes to name its waiting line's row (``line``).
LINE: Final = ":tasklock-line"
#: The waiters of the line of the lock at $1 woken: one ``NOTIFY`` when its
#: row lists any (a subquery of a release's reply; none, no notify at all).
_WAKE = f"""(SELECT pg_notify('{CHANNEL}', md5($1)) FROM {TABLE} AS l
    WHERE l.key = $1 || '{LINE}' AND l.expires > {_NOW} AND l.value <> '')"""

#: $1 key, $2 token: freed while the token holds it (the row kept, its expiry
#: past: the next take of the key updates it in place, a HOT update), and
#: its line's waiters woken.
RELEASE: Final = f"""
WITH freed AS (
    UPDATE {TABLE} AS t SET expires = '-infinity'
    WHERE key = $1 AND value = $2 AND NOT pickled AND {_LIVE} RETURNING 1
)
SELECT 1, {_WAKE} FROM freed""".encode()

#: $1 key, $2 token, $3 seconds: the expiry reset while the token holds it.
EXTEND: Final = f"""
UPDATE {TABLE} AS t SET expires = {_UNTIL}
WHERE key = $1 AND value = $2 AND NOT pickled AND {_LIVE} RETURNING 1""".encode()

#: $1 key, $2 old value, $3 seconds, $4 new value.
REPLACE: Final = f"""
UPDATE {TABLE} AS t SET value = $4, expires = {_UNTIL}
WHERE key = $1 AND value = $2 AND NOT pickled AND {_LIVE} RETURNING 1""".encode()

#: $1 key, $2 token, $3 the counter's seconds, $4 the counter's key, $5 where
#: a missing counter starts: the next fence, drawn only while the token holds
#: the lock (the lock's row locked meanwhile). Its columns: the fence drawn
#: (NULL: none), whether the token held the lock, and the counter as it was.
FENCE: Final = f"""
WITH held AS (
    SELECT 1 FROM {TABLE} AS t
    WHERE key = $1 AND value = $2 AND NOT pickled AND {_LIVE} FOR UPDATE
), drawn AS (
    INSERT INTO {TABLE} AS t (key, value, expires)
    SELECT $4, $5, {_UNTIL} FROM held
    ON CONFLICT (key) DO UPDATE
    SET value = CASE WHEN t.expires <= {_NOW} THEN excluded.value
                ELSE (t.value::bigint + 1)::text END,
        pickled = false, expires = excluded.expires
    WHERE t.expires <= {_NOW} OR (t.value ~ '^[0-9]{{1,18}}$' AND NOT t.pickled)
    RETURNING value
)
SELECT (SELECT value FROM drawn), EXISTS (SELECT 1 FROM held),
    (SELECT value FROM {TABLE} AS t WHERE key = $4 AND {_LIVE})""".encode()

#: $1 key: the live value (and whether it is pickled) and seconds left.
READ: Final = f"""
SELECT value, pickled, CASE WHEN t.expires = 'infinity' THEN 'Infinity'::float8
    ELSE extract(epoch FROM t.expires - {_NOW})::float8 END
FROM {TABLE} AS t WHERE key = $1 AND {_LIVE}""".encode()

#: $1 keys (a text[]): each live key and its value and whether pickled.
READ_MANY: Final = f"""
SELECT key, value, pickled FROM {TABLE} AS t
WHERE key = ANY($1::text[]) AND {_LIVE}""".encode()

#: $1 key, $2 value, $3 seconds, $4 pickled: stored whatever was there.
WRITE: Final = f"""
INSERT INTO {TABLE} AS t (key, value, expires, pickled)
VALUES ($1, $2, {_UNTIL}, $4::boolean)
ON CONFLICT (key) DO UPDATE
SET value = excluded.value, pickled = excluded.pickled, expires = excluded.expires
""".encode()

#: $1 keys, $2 values (text[]), $3 seconds: stored whatever was there.
WRITE_MANY: Final = f"""
INSERT INTO {TABLE} AS t (key, value, expires)
SELECT k, v, {_UNTIL} FROM unnest($1::text[], $2::text[]) AS n(k, v)
ON CONFLICT (key) DO UPDATE
SET value = excluded.value, pickled = false, expires = excluded.expires
""".encode()

#: $1 key, $2 value, $3 seconds, $4 pickled: stored unless a live row is there.
ADD: Final = f"""
INSERT INTO {TABLE} AS t (key, value, expires, pickled)
VALUES ($1, $2, {_UNTIL}, $4::boolean)
ON CONFLICT (key) DO UPDATE
SET value = excluded.value, pickled = excluded.pickled, expires = excluded.expires
WHERE t.expires <= {_NOW} RETURNING 1""".encode()

#: $1 key, $2 token: freed while it stores the token, live or not.
DISCARD: Final = f"""
WITH freed AS (
    UPDATE {TABLE} SET expires = '-infinity'
    WHERE key = $1 AND value = $2 AND NOT pickled AND expires > '-infinity'
    RETURNING 1
)
SELECT 1, {_WAKE} FROM freed""".encode()

#: $1 key: removed; whether a live row was.
DELETE: Final = f"DELETE FROM {TABLE} AS t WHERE key = $1 RETURNING {_LIVE}".encode()

#: $1 keys (text[]).
DELETE_MANY: Final = f"DELETE FROM {TABLE} WHERE key = ANY($1::text[])".encode()

#: $1 key, $3 seconds: a live row's expiry reset ($2 unused).
TOUCH: Final = f"""
UPDATE {TABLE} AS t SET expires = {_UNTIL}
WHERE key = $1 AND $2::text IS NULL AND {_LIVE} RETURNING 1""".encode()

#: Every row but the run's record (Django's ``cache.clear()``).
CLEAR: Final = f"DELETE FROM {TABLE} WHERE key <> '{RUN_KEY}'".encode()

#: At most a batch of rows expired a minute or more ago, removed (a minute:
#: a client's statement in flight on a row just expired has ended by then).
SWEEP: Final = f"""
DELETE FROM {TABLE} WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {TABLE}
    WHERE expires < {_NOW} - interval '1 minute' LIMIT 1000
))""".encode()


# A lock's waiting line (``line``): one row beside the lock, its key the
# lock's and ``LINE``, its value the waiters in the order they came, each
# ``<waiter>/<until>`` (until: its mark's end, in the server's epoch
# seconds), separated by spaces. A waiter whose mark ended is passed over
# and dropped by the next write; the row lasts twice a mark past the last.
_ENTRIES = "unnest(string_to_array({0}, ' ')) WITH ORDINALITY AS u(e, n)"
_WAITER = "split_part(u.e, '/', 1)"
_UNTIL_OF = "split_part(u.e, '/', 2)::float8"
#: Whether the try took the lock; whether the waiter was in line before it.
_TOOK = "EXISTS (SELECT 1 FROM took)"
_MINE = "EXISTS (SELECT 1 FROM line WHERE waiter = $4::text)"
#: The line's stored value, empty if its row expired.
_STORED = f"CASE WHEN {_LIVE} AND NOT t.pickled THEN t.value ELSE '' END"
#: A place after any waiter's.
_LAST = "9223372036854775807"

#: $1 key, $2 token, $3 seconds, $4 waiter, $5 its mark's seconds, $6 the
#: run mark: the lock taken if free and no live waiter is before $4 in its
#: line (then $4 leaves the line), else $4 joins the line or renews its mark
#: there. One row: whether it took, how many waiters are before $4, and the
#: server's run mark (nothing done on another run).
TAKE_IN_LINE: Final = f"""
WITH here AS (
    SELECT {RUN_MARK} AS run, extract(epoch FROM {_NOW})::float8 AS at
), line AS (
    SELECT {_WAITER} AS waiter, u.n
    FROM {TABLE} AS t, {_ENTRIES.format("t.value")}, here
    WHERE t.key = $1 || '{LINE}' AND {_LIVE} AND NOT t.pickled
        AND {_UNTIL_OF} > here.at
), ahead AS (
    SELECT count(*) AS n FROM line
    WHERE line.n < COALESCE((SELECT n FROM line WHERE waiter = $4::text), {_LAST})
), took AS (
    INSERT INTO {TABLE} AS t (key, value, expires)
    SELECT $1, $2, {_UNTIL} FROM here, ahead WHERE here.run = $6 AND ahead.n = 0
    ON CONFLICT (key) DO UPDATE
    SET value = excluded.value, pickled = false, expires = excluded.expires
    WHERE t.expires <= {_NOW} OR (t.value = excluded.value AND NOT t.pickled)
    RETURNING 1
), joined AS (
    INSERT INTO {TABLE} AS t (key, value, expires)
    SELECT $1 || '{LINE}', $4::text || '/' || (here.at + $5::float8)::text,
        {_NOW} + 2 * $5::float8 * interval '1 second'
    FROM here
    WHERE here.run = $6 AND (NOT {_TOOK} OR {_MINE})
    ON CONFLICT (key) DO UPDATE
    SET value = (
        SELECT COALESCE(string_agg(k.e, ' ' ORDER BY k.n), '') FROM (
            SELECT CASE WHEN {_WAITER} = $4::text THEN excluded.value ELSE u.e END,
                u.n
            FROM {_ENTRIES.format(_STORED)}
            WHERE {_UNTIL_OF} > (SELECT at FROM here)
                AND NOT ({_WAITER} = $4::text AND {_TOOK})
            UNION ALL
            SELECT excluded.value, {_LAST} WHERE NOT {_TOOK} AND NOT {_MINE}
        ) AS k (e, n)
    ), pickled = false, expires = GREATEST(t.expires, excluded.expires)
    RETURNING 1
)
SELECT (SELECT count(*) FROM took), ahead.n, here.run FROM here, ahead""".encode()

#: $1 key, $2 waiter: out of the line; the waiters left woken (the turn may
#: have been the one that left).
LEAVE_LINE: Final = f"""
WITH left_line AS (
    UPDATE {TABLE} AS t SET value = (
        SELECT COALESCE(string_agg(u.e, ' ' ORDER BY u.n), '')
        FROM {_ENTRIES.format("t.value")} WHERE {_WAITER} <> $2
    )
    WHERE key = $1 || '{LINE}' AND {_LIVE} AND NOT pickled
        AND position(' ' || $2 || '/' IN ' ' || t.value) > 0
    RETURNING t.value
)
SELECT pg_notify('{CHANNEL}', md5($1)) FROM left_line WHERE value <> ''""".encode()


def seconds(timeout: float) -> str:
    """A lifetime in seconds, as a statement's ``$3``."""
    return repr(float(timeout))


def array(values: list[str]) -> str:
    """A text[] literal of ``values``, as a statement's parameter."""
    quoted = (
        '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"' for value in values
    )
    return "{" + ",".join(quoted) + "}"
