#!/usr/bin/env bash
# Makes the certificates the security tests use, with the openssl CLI, into DIR:
#   ca.crt/.key            the test CA
#   server.crt/.key        signed by it: SAN DNS:localhost, IP:127.0.0.1 (serial 1)
#   server2.crt/.key       the same names, another key (serial 2): the rotated certificate
#   client.crt/.key        signed by the CA: SAN DNS:trainer-0 (a trainer's identity)
#   client1.crt/.key       signed by the CA: SAN DNS:trainer-1
#   other-ca.crt/.key      a second CA
#   other-client.crt/.key  signed by the second CA: SAN DNS:trainer-0
#   bench-client.crt/.key  signed by the CA: SANs DNS:fusedps-bench-0 ... fusedps-bench-31 (the
#                          client_ids of fusedps-bench's trainers, for mTLS benchmarks)
# EC P-256 keys, valid for a day.
#   make_test_certs.sh DIR
set -euo pipefail
dir=$1
mkdir -p "$dir"
cd "$dir"

ca() {  # NAME SUBJECT
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
    -subj "/CN=$2" -keyout "$1.key" -out "$1.crt" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign 2>/dev/null
}

leaf() {  # NAME CA SERIAL SUBJECT SAN USAGE
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=$4" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\nbasicConstraints=CA:FALSE\n' "$5" "$6" \
    >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.crt" -CAkey "$2.key" -set_serial "$3" -days 1 \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca "fusedps test CA"
ca other-ca "another CA"
leaf server ca 1 "fusedps test server" "DNS:localhost,IP:127.0.0.1" serverAuth
leaf server2 ca 2 "fusedps test server (rotated)" "DNS:localhost,IP:127.0.0.1" serverAuth
leaf client ca 3 "trainer-0" "DNS:trainer-0" clientAuth
leaf client1 ca 4 "trainer-1" "DNS:trainer-1" clientAuth
leaf other-client other-ca 5 "trainer-0" "DNS:trainer-0" clientAuth
leaf bench-client ca 6 "fusedps-bench" \
  "$(seq -f 'DNS:fusedps-bench-%g' 0 31 | paste -sd,)" clientAuth
