package hmackey

import (
	"bytes"
	"testing"
)

// A key reads the same from a mounted file and from the Secret's data: trailing line
// breaks go, everything else stays.
func TestParse(t *testing.T) {
	cases := []struct {
		in      string
		want    string
		wantErr bool
	}{
		{"k3y", "k3y", false},
		{"k3y\n", "k3y", false},
		{"k3y\r\n\n", "k3y", false},
		{" k3y \n", " k3y ", false},
		{"line1\nline2\n", "line1\nline2", false},
		{"", "", true},
		{"\n\r\n", "", true},
	}
	for _, tc := range cases {
		got, err := Parse([]byte(tc.in))
		if (err != nil) != tc.wantErr || !bytes.Equal(got, []byte(tc.want)) {
			t.Errorf("Parse(%q) = %q, %v; want %q (error %v)", tc.in, got, err, tc.want, tc.wantErr)
		}
	}
}
