-- A source's credits in byte order of their keys, whatever the database's default
-- collation: GET /v1/sources/{uid}/credits pages with ORDER BY idempotency_key
-- COLLATE "C" and a key after the last one read, which this index answers a page at
-- a time instead of sorting every credit after it (the operator's reconciliation
-- pages through a source of a million credits).
CREATE INDEX credits_by_source_bytes ON credits (source_uid, idempotency_key COLLATE "C");
DROP INDEX credits_by_source;
