#!/bin/sh
# Twin stand-in for the block-device side of the ESPs, which a chroot cannot have: lsblk(8),
# blkid(8), mount(8) and umount(8), dispatched on the program's name and run in the caller's
# own process and mount namespace (proxmox-boot-tool re-executes itself in a private one:
# functions reexec_in_mountns). Each ESP of this boot is a line of /var/lib/twin/hw/esp-devices
# ("<name> <uuid> <parent disk> <size in bytes>", written by tests/twin/hardware.py render with
# the block node /dev/<name> and the link /dev/disk/by-uuid/<uuid>); its vfat file system is
# the directory /var/lib/twin/esp/<uuid>, which `mount` of the device binds where it is asked
# to. Anything else goes to the real program. bootctl: systemd's own, its ESP checks relaxed.
TABLE=/var/lib/twin/hw/esp-devices
ESP_ROOT=/var/lib/twin/esp
ESPTYPE=c12a7328-f81f-11d2-ba4b-00a0c93ec93b # the GPT type of an EFI system partition
prog=${0##*/}

# esp_line DEV: the table's line of the ESP device DEV (any path resolving to /dev/<name>), else fail
esp_line() {
	[ -f "$TABLE" ] || return 1
	dev=$(realpath -- "$1" 2>/dev/null) || return 1
	case "$dev" in /dev/*) ;; *) return 1 ;; esac
	line=$(awk -v n="${dev#/dev/}" '$1 == n { print; exit }' "$TABLE")
	[ -n "$line" ] || return 1
	# shellcheck disable=SC2086  # the line's fields
	set -- $line
	name=$1 uuid=$2 pkname=$3 size=$4
}

# mounted_at UUID: the mount points (this namespace, oldest first) where that ESP's directory is
# bound: /proc/self/mountinfo's 4th field (the root of the mount within its file system) and 5th
mounted_at() {
	awk -v r="$ESP_ROOT/$1" '$4 == r { print $5 }' /proc/self/mountinfo
}

real() {
	for d in /usr/bin /bin /usr/sbin /sbin; do
		[ -x "$d/$prog" ] && exec "$d/$prog" "$@"
	done
	echo "$prog: not found" >&2
	exit 127
}

case "$prog" in
lsblk)
	# util-linux lsblk: -b/--bytes, -P/--pairs, -n/--noheadings, -o/--output LIST for one device
	bytes="" pairs="" noheadings="" cols="NAME,MAJ:MIN,RM,SIZE,RO,TYPE,MOUNTPOINT" dev="" n=0 want=""
	for a do
		if [ -n "$want" ]; then cols=$a want=""; continue; fi
		case "$a" in
		-b|--bytes) bytes=1 ;;
		-P|--pairs) pairs=1 ;;
		-n|--noheadings) noheadings=1 ;;
		-o|--output) want=1 ;;
		-o*) cols=${a#-o} ;;
		--output=*) cols=${a#--output=} ;;
		-*) n=99 ;;
		*) dev=$a; n=$((n + 1)) ;;
		esac
	done
	if [ "$n" -ne 1 ] || ! esp_line "$dev"; then real "$@"; fi
	mp=$(mounted_at "$uuid" | tail -n 1)
	out="" head=""
	for col in $(echo "$cols" | tr ',' ' '); do
		case "$col" in
		NAME|KNAME) v=$name ;;
		PKNAME) v=$pkname ;;
		UUID) v=$uuid ;;
		FSTYPE) v=vfat ;;
		PARTTYPE) v=$ESPTYPE ;;
		TYPE) v=part ;;
		MOUNTPOINT) v=$mp ;;
		SIZE) if [ -n "$bytes" ]; then v=$size; else v="$((size / 1048576))M"; fi ;;
		*) v="" ;;
		esac
		if [ -n "$pairs" ]; then
			out="$out${out:+ }$col=\"$v\""
		else
			out="$out${out:+ }$v" head="$head${head:+ }$col"
		fi
	done
	[ -n "$pairs" ] || [ -n "$noheadings" ] || echo "$head"
	echo "$out"
	;;
blkid)
	# util-linux blkid DEV, blkid -o value -s TAG DEV, blkid -U UUID
	fmt="" tag="" dev="" want="" n=0
	for a do
		case "$want" in
		o) fmt=$a want=""; continue ;;
		s) tag=$a want=""; continue ;;
		U) want=""
			if [ -f "$TABLE" ] && d=$(awk -v u="$a" '$2 == u { print "/dev/" $1; exit }' "$TABLE") && [ -n "$d" ]; then
				echo "$d"; exit 0
			fi
			real "$@" ;;
		esac
		case "$a" in
		-o) want=o ;;
		-s) want=s ;;
		-U) want=U ;;
		-*) n=99 ;;
		*) dev=$a; n=$((n + 1)) ;;
		esac
	done
	if [ "$n" -ne 1 ] || ! esp_line "$dev"; then real "$@"; fi
	if [ "$fmt" = value ]; then
		case "$tag" in UUID) echo "$uuid" ;; TYPE) echo vfat ;; "") echo "$uuid"; echo vfat ;; esac
	else
		echo "$dev: UUID=\"$uuid\" BLOCK_SIZE=\"512\" TYPE=\"vfat\""
	fi
	;;
mount)
	# mount [-t vfat] [-o OPTIONS] DEV DIR for an ESP device: its directory bound on DIR (the
	# options of a vfat mount, umask=…, have no bind equivalent and are not applied)
	fstype="" dev="" dir="" n=0 want=""
	for a do
		case "$want" in
		t) fstype=$a want=""; continue ;;
		o) want=""; continue ;;
		esac
		case "$a" in
		-t) want=t ;;
		-o) want=o ;;
		-*) n=99 ;;
		*) n=$((n + 1)); if [ "$n" -eq 1 ]; then dev=$a; else dir=$a; fi ;;
		esac
	done
	case "$dev" in
	/dev/disk/by-uuid/*|/dev/sd*|/dev/nvme*|/dev/vd*)
		if [ "$n" -eq 2 ]; then
			if ! esp_line "$dev"; then
				echo "mount: $dir: special device $dev does not exist." >&2
				exit 32
			fi
			if [ -n "$fstype" ] && [ "$fstype" != vfat ]; then
				echo "mount: $dir: wrong fs type, bad option, bad superblock on $dev, missing codepage or helper program, or other error." >&2
				exit 32
			fi
			if [ ! -d "$dir" ]; then
				echo "mount: $dir: mount point does not exist." >&2
				exit 32
			fi
			exec /usr/bin/mount --bind "$ESP_ROOT/$uuid" "$dir"
		fi
		;;
	esac
	real "$@"
	;;
umount)
	# umount DEV for an ESP device: its last mount in this namespace (as util-linux umount finds
	# a mounted source), else "not mounted"
	if [ "$#" -eq 1 ] && esp_line "$1"; then
		mp=$(mounted_at "$uuid" | tail -n 1)
		if [ -z "$mp" ]; then
			echo "umount: $1: not mounted." >&2
			exit 32
		fi
		exec /usr/bin/umount "$mp"
	fi
	real "$@"
	;;
bootctl)
	# systemd's real bootctl: the ESP is a directory bound where it is mounted, not a vfat file
	# system on a GPT partition, so bootctl's checks of those (src/shared/find-esp.c verify_esp:
	# statfs's f_type, the partition's type through blkid) are relaxed, as systemd's
	# SYSTEMD_RELAX_ESP_CHECKS provides; the EFI variables and the ESP's files are its own work.
	# One thing the twin cannot be is the initial PID namespace: from v254 systemd's
	# detect_container() takes any other for a container, and bootctl verb_set_efivar then refuses
	# set-oneshot/set-default ("not supported in a container"). Only where that is the refusal, the
	# verb is done as verb_set_efivar would go on: UEFI boot and LoaderInfo required, the id as
	# UTF-16LE with its NUL after the attributes NV|BS|RT (efi_set_variable), '' deletes it.
	out=$(SYSTEMD_RELAX_ESP_CHECKS=1 /usr/bin/bootctl "$@" 2>&1); rc=$?
	case "$rc:$1:$out" in
	0:*) [ -z "$out" ] || printf '%s\n' "$out"; exit 0 ;;
	*:set-oneshot:*"operation not supported in a container"*|*:set-default:*"operation not supported in a container"*|*:set-oneshot:"Not booted with UEFI."|*:set-default:"Not booted with UEFI.")
		# (is_efi_boot() is false in a "container" too: UEFI is /sys/firmware/efi, as it reads)
		[ -d /sys/firmware/efi ] || { printf '%s\n' "$out" >&2; exit "$rc"; }
		[ "$#" -eq 2 ] || { printf '%s\n' "$out" >&2; exit "$rc"; }
		var=LoaderEntryOneShot; [ "$1" = set-default ] && var=LoaderEntryDefault
		f=/sys/firmware/efi/efivars/$var-4a67b082-0a4c-41cf-b6c7-440b29bb8c4f
		[ -e /sys/firmware/efi/efivars/LoaderInfo-4a67b082-0a4c-41cf-b6c7-440b29bb8c4f ] || {
			echo "Not booted with a supported boot loader." >&2; exit 1; }
		if [ -z "$2" ]; then rm -f "$f"; exit 0; fi
		{ printf '\007\000\000\000'; printf '%s\000' "$2" | iconv -f UTF-8 -t UTF-16LE; } > "$f"
		exit 0 ;;
	esac
	printf '%s\n' "$out" >&2
	exit "$rc"
	;;
grub-install.real)
	# GRUB's grub-install (proxmox-kernel-helper diverts it to grub-install.real) as proxmox-boot-tool
	# init_bootloader runs it on an ESP: --boot-directory and --efi-directory the ESP's mount. The
	# twin cannot give it what it probes (the ESP's disk and vfat file system through grub-probe), so
	# this does what grub util/grub-install.c then does there: the platform's files from
	# /usr/lib/grub/<target> (grub-install fails as here where its modinfo.sh is missing) copied to
	# <boot-directory>/grub/<target>, grubenv created where there is none (never rewritten), and
	# for x86_64-efi the image at EFI/<bootloader-id>/grubx64.efi of the EFI directory (--removable:
	# EFI/BOOT/BOOTX64.EFI), here a text naming the package version it came from. Any other use:
	# the real program.
	target="" bootdir="" efidir="" id="" removable="" want="" n=0
	for a do
		case "$want" in
		t) target=$a want=""; continue ;;
		b) bootdir=$a want=""; continue ;;
		e) efidir=$a want=""; continue ;;
		i) id=$a want=""; continue ;;
		esac
		case "$a" in
		--target) want=t ;;
		--target=*) target=${a#--target=} ;;
		--boot-directory) want=b ;;
		--boot-directory=*) bootdir=${a#--boot-directory=} ;;
		--efi-directory) want=e ;;
		--efi-directory=*) efidir=${a#--efi-directory=} ;;
		--bootloader-id) want=i ;;
		--bootloader-id=*) id=${a#--bootloader-id=} ;;
		--removable) removable=1 ;;
		--no-floppy) ;;
		-*) n=99 ;;
		*) n=$((n + 1)) ;;
		esac
	done
	mp=$(awk -v d="$bootdir" -v r="$ESP_ROOT/" '$5 == d && index($4, r) == 1 { print $5 }' /proc/self/mountinfo)
	if [ "$n" -gt 1 ] || [ -z "$target" ] || [ -z "$mp" ]; then real "$@"; fi
	src=/usr/lib/grub/$target
	if [ ! -f "$src/modinfo.sh" ]; then
		echo "grub-install.real: error: $src/modinfo.sh doesn't exist. Please specify --target or --directory." >&2
		exit 1
	fi
	echo "Installing for $target platform."
	mkdir -p "$bootdir/grub/$target"
	cp -r "$src/." "$bootdir/grub/$target/"
	if [ ! -f "$bootdir/grub/grubenv" ]; then # grub_util_create_envblk_file: 1024 bytes
		{ printf '# GRUB Environment Block\n'; head -c 999 /dev/zero | tr '\0' '#'; } > "$bootdir/grub/grubenv"
	fi
	case "$target" in
	x86_64-efi)
		[ -n "$efidir" ] || { echo "grub-install.real: error: cannot find EFI directory." >&2; exit 1; }
		dest="$efidir/EFI/${id:-debian}/grubx64.efi"
		[ -z "$removable" ] || dest="$efidir/EFI/BOOT/BOOTX64.EFI"
		mkdir -p "${dest%/*}"
		pkg=$(dpkg-query -S "$src/modinfo.sh" 2>/dev/null | cut -d: -f1)
		printf 'twin GRUB image: %s %s\n' "$pkg" "$(dpkg-query -W -f '${Version}' "$pkg" 2>/dev/null)" > "$dest"
		;;
	esac
	echo "Installation finished. No error reported."
	;;
systemd-detect-virt)
	# systemd's own, except for the one reason a twin is not a host: its PID namespace is not the
	# initial one, which systemd (virt.c detect_container, v254+) takes for an unknown container
	quiet="" container=""
	for a do
		case "$a" in -q|--quiet) quiet=1 ;; -c|--container) container=1 ;; -cq|-qc) quiet=1 container=1 ;; esac
	done
	out=$(/usr/bin/systemd-detect-virt ${container:+--container}); rc=$?
	if [ "$out" = container-other ] && [ ! -e /run/systemd/container ] \
		&& ! tr '\0' '\n' </proc/1/environ 2>/dev/null | grep -q '^container='; then
		if [ -n "$container" ]; then out=none rc=1; else out=$(/usr/bin/systemd-detect-virt --vm); rc=$?; fi
	fi
	[ -n "$quiet" ] || printf '%s\n' "$out"
	exit "$rc"
	;;
*)
	echo "twin esp stand-in: unknown program name $prog" >&2
	exit 127
	;;
esac
