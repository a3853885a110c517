package printed

import "testing"

func TestFirstRow(t *testing.T) {
	table := "NAME   TOTAL   REMAINING   PHASE    START   END\n" +
		"rain   100     7           Active\n" +
		"other  200     0           Expired\n"
	got, err := FirstRow(table)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"NAME": "rain", "TOTAL": "100", "REMAINING": "7", "PHASE": "Active", "START": "", "END": ""}
	if len(got) != len(want) {
		t.Fatalf("FirstRow = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
	if _, err := FirstRow("NAME   TOTAL\n"); err == nil {
		t.Error("a table without a row was read")
	}
}
