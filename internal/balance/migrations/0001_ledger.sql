-- The reference balance system's book. Money is BIGINT in the currency's minor unit.

-- One row per activity or budget UID, made by its first announcement. total is the
-- announced amount (for a budget, the highest announced: an announcement never
-- lowers it); count is an activity's number of packets (a budget has none). The
-- running sums are kept inside the same transaction as each credit, under this
-- row's lock, and the CHECKs hold them to the announcement.
CREATE TABLE sources (
	uid        text PRIMARY KEY,
	kind       text NOT NULL CHECK (kind IN ('activity', 'budget')),
	name       text NOT NULL,
	currency   text NOT NULL,
	total      bigint NOT NULL CHECK (total > 0),
	count      bigint CHECK (count > 0),
	grants     bigint NOT NULL DEFAULT 0 CHECK (grants >= 0),
	grant_sum  bigint NOT NULL DEFAULT 0 CHECK (grant_sum >= 0),
	refunds    bigint NOT NULL DEFAULT 0 CHECK (refunds >= 0),
	refund_sum bigint NOT NULL DEFAULT 0 CHECK (refund_sum >= 0),
	created_at timestamptz NOT NULL DEFAULT now(),
	CONSTRAINT count_for_activities CHECK ((kind = 'activity') = (count IS NOT NULL)),
	CONSTRAINT credited_within_total CHECK (grant_sum + refund_sum <= total),
	CONSTRAINT grants_within_count CHECK (count IS NULL OR grants <= count)
);

-- Every announcement booked, by its Idempotency-Key, with the digest of its body.
CREATE TABLE announcements (
	idempotency_key text PRIMARY KEY,
	source_uid      text NOT NULL REFERENCES sources (uid),
	amount          bigint NOT NULL CHECK (amount > 0),
	count           bigint CHECK (count > 0),
	digest          bytea NOT NULL CHECK (length(digest) = 32),
	at              timestamptz NOT NULL,
	booked_at       timestamptz NOT NULL DEFAULT now()
);

-- Every credit booked, once, by its Idempotency-Key. at is the claim's time (the
-- body's), booked_at the booking's.
CREATE TABLE credits (
	idempotency_key text PRIMARY KEY,
	digest          bytea NOT NULL CHECK (length(digest) = 32),
	kind            text NOT NULL CHECK (kind IN ('grant', 'refund')),
	user_id         text NOT NULL,
	amount          bigint NOT NULL CHECK (amount > 0),
	currency        text NOT NULL,
	source_uid      text NOT NULL REFERENCES sources (uid),
	packet_id       text NOT NULL,
	at              timestamptz NOT NULL,
	booked_at       timestamptz NOT NULL DEFAULT now()
);

-- A source's credits in key order, for GET /v1/sources/{uid}/credits.
CREATE INDEX credits_by_source ON credits (source_uid, idempotency_key);

-- Each user's balance per currency: the sum of the credits booked to them.
CREATE TABLE balances (
	user_id  text NOT NULL,
	currency text NOT NULL,
	amount   bigint NOT NULL CHECK (amount >= 0),
	credits  bigint NOT NULL CHECK (credits >= 0),
	PRIMARY KEY (user_id, currency)
);
