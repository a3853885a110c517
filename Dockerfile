# syntax=docker/dockerfile:1
# The operator image: /manager (the controller, the entrypoint) and /grabsvc (the
# grab service, which the operator runs in every activity's grab Deployment), both
# static binaries on an empty base, running as a non-root user.
#
# `make image` (hack/image) builds the same layout without Docker; keep the two in
# step: hack/image/layout_test.go compares this file's final stage (COPY
# destinations and modes, USER, EXPOSE, ENTRYPOINT) with the image it builds.

FROM golang:1.26 AS build
WORKDIR /src
ENV CGO_ENABLED=0 GOOS=linux GOFLAGS=-trimpath
# Modules first, so source edits do not invalidate the download layer.
COPY go.mod go.sum ./
RUN go mod download
COPY api/ api/
COPY cmd/manager/ cmd/manager/
COPY cmd/grabsvc/ cmd/grabsvc/
COPY controllers/ controllers/
COPY grabsvc/ grabsvc/
COPY internal/version/ internal/version/
COPY lua/ lua/
COPY settlement/ settlement/
COPY store/ store/
ARG TARGETARCH
# The version --version prints: docker build --build-arg VERSION=$(git describe --tags --always --dirty)
ARG VERSION=dev
RUN GOARCH=${TARGETARCH:-amd64} go build -ldflags="-s -w -X redpacket.io/operator/internal/version.version=${VERSION}" -o /out/manager ./cmd/manager && \
    GOARCH=${TARGETARCH:-amd64} go build -ldflags="-s -w -X redpacket.io/operator/internal/version.version=${VERSION}" -o /out/grabsvc ./cmd/grabsvc

FROM scratch
# CA roots for Redis over TLS and https webhooks.
COPY --from=build --chmod=0644 /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build --chmod=0755 /out/manager /manager
COPY --from=build --chmod=0755 /out/grabsvc /grabsvc
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["/manager"]
