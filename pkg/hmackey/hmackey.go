// Package hmackey reads the HMAC keys of the project (the grab tokens' keys and the
// settlement signing keys) as a Secret or a mounted key file holds them. It is
// small and imports nothing of the project, so the operator's packages and the
// tenant-side grab service read a key the same way without depending on each
// other.
package hmackey

import (
	"bytes"
	"errors"
)

// Parse returns an HMAC key as stored in a Secret or a mounted key file: trailing
// line breaks are removed (kubectl create secret --from-file keeps the file's last
// newline), every other byte is part of the key. An empty key is an error. Every
// reader of a key uses it.
func Parse(data []byte) ([]byte, error) {
	key := bytes.TrimRight(data, "\r\n")
	if len(key) == 0 {
		return nil, errors.New("the key is empty")
	}
	return key, nil
}
