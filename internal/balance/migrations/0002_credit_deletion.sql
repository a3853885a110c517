-- A credit deleted from the book (by hand, or by a restore that lost it) takes its
-- amount out of its source's running sums and its user's balance in the same
-- statement, so the sums stay the sums of the rows and the key can be booked again
-- within the announced total when the operator's reconciliation delivers it anew.
-- Inserting is the booking's own work (book.go), which updates the sums itself.
CREATE FUNCTION credit_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF OLD.kind = 'refund' THEN
		UPDATE sources SET refunds = refunds - 1, refund_sum = refund_sum - OLD.amount WHERE uid = OLD.source_uid;
	ELSE
		UPDATE sources SET grants = grants - 1, grant_sum = grant_sum - OLD.amount WHERE uid = OLD.source_uid;
	END IF;
	UPDATE balances SET amount = amount - OLD.amount, credits = credits - 1
		WHERE user_id = OLD.user_id AND currency = OLD.currency;
	RETURN OLD;
END;
$$;

CREATE TRIGGER credit_deleted AFTER DELETE ON credits FOR EACH ROW EXECUTE FUNCTION credit_deleted();
